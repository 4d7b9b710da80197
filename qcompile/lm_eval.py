"""qcompile models in EleutherAI's lm-evaluation-harness: the ``qcompile`` model.

    python -m qcompile.lm_eval --model qcompile --model_args pretrained=out/awq --tasks wikitext,hellaswag

``pretrained`` is anything ``qcompile.load`` takes (an artifact, a HF directory, a ``.gguf`` file,
``smollm2``). lm-eval (``pip install -e '.[lm-eval]'``) finds models by importing them and reads no
plugin entry points, so its own ``lm_eval`` command does not know ``qcompile``: ``python -m
qcompile.lm_eval`` is that command with this module imported; in Python, ``import qcompile.lm_eval``
before ``lm_eval.simple_evaluate(model="qcompile", ...)``, or pass ``QCompileLM(...)`` as the model.

The three request types run on the loaded model's plain forward (``model(input_ids) -> logits``),
tokenized and windowed as lm-eval's ``hf`` model (HFLM) does, so the figures compare with its:
``loglikelihood`` encodes context + continuation whole, then splits (lm-eval's ``TemplateLM``);
``loglikelihood_rolling`` scores lm-eval's disjoint rolling windows of ``max_length`` tokens;
``generate_until`` decodes with a KV cache, greedy unless the request samples, until a stop string.
"""
from __future__ import annotations

import logging
from dataclasses import replace

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from compiler.errors import ConfigError
from serving.adapters._stream import token_events
from serving.reference import ReferenceDecoder
from serving.request import Request
from serving.types import SamplingParams

log = logging.getLogger(__name__)

# generate_until's keys beyond lm-eval's normalized ones (do_sample, temperature, until, max_gen_toks)
SAMPLING_KEYS = ("top_k", "top_p", "seed")


@register_model("qcompile")
class QCompileLM(TemplateLM):
    """A qcompile model for lm-eval. ``pretrained``: what ``qcompile.load`` takes, or a ``LoadedModel``;
    ``dtype`` applies to checkpoints (artifacts keep theirs); ``max_length``: tokens per forward
    (default the model's maximum positions); ``batch_size``: rows per loglikelihood forward;
    ``allow_pickle``: as ``qcompile.load`` (off: pickled checkpoints are refused). ``max_batch_size``
    is taken because lm-eval passes it, and unused."""

    def __init__(self, pretrained, dtype: str = "float32", batch_size: int | str = 1, max_length: int | None = None,
                 device: str | None = None, add_bos_token: bool | None = None, max_gen_toks: int = 256,
                 max_batch_size: int | None = None, allow_pickle: bool = False):
        super().__init__()
        self.loaded = _load(pretrained, dtype, allow_pickle)
        if self.loaded.tokenizer is None:
            raise ConfigError(f"{pretrained}: lm-eval needs a tokenizer, and this model ships none")
        self.tokenizer = self.loaded.tokenizer
        self.model = self.loaded.model.eval()
        self._device = _device(device)
        self.model.to(self._device)
        self.batch_size = _batch_size(batch_size)
        self.max_length = int(max_length or self.model.config.max_seq_len)
        self.add_bos_token = add_bos_token
        self.max_gen_toks = int(max_gen_toks)

    # --- tokens -------------------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        eos = self.tokenizer.eos_token_id
        return eos if eos is not None else self.model.config.eos_token_ids[0]

    @property
    def prefix_token_id(self) -> int:
        # What an empty context and the first rolling window condition on: BOS, else EOS (as HFLM).
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs) -> list[int]:
        """The tokenizer's ids; special tokens as the tokenizer adds them unless told (as HFLM),
        never a second BOS where the text starts with one."""
        if add_special_tokens is None:
            add_special_tokens = self.add_bos_token
        if add_special_tokens is None and string.startswith(self.tokenizer.decode(self.prefix_token_id)):
            add_special_tokens = False
        special = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        ids = self.tokenizer.encode(string, **special)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    # --- loglikelihood -------------------------------------------------------------------------

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """``(sum of log p(continuation | context), whether greedy decoding gives the continuation)``
        for each ``(key, context_ids, continuation_ids)``, ``batch_size`` rows per forward."""
        # Longest first, so that a batch's right padding stays small.
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        results: list = [None] * len(requests)
        progress = tqdm(total=len(requests), disable=disable_tqdm, desc="qcompile: loglikelihood requests")
        for start in range(0, len(order), self.batch_size):
            batch = order[start:start + self.batch_size]
            rows = [self._input_row(requests[i][1], requests[i][2]) for i in batch]
            for i, scored in zip(batch, self._score_rows(rows)):
                results[i] = scored
                if requests[i][0] is not None:  # rolling windows are cached per document, not per window
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], scored)
            progress.update(len(batch))
        progress.close()
        return results

    def _input_row(self, context: list[int], continuation: list[int]) -> tuple[list[int], list[int]]:
        """The model input for one request (context + continuation minus its last token, cut from the
        left to ``max_length``) and the continuation it predicts."""
        if not context or not continuation or len(continuation) > self.max_length:
            raise ValueError(f"cannot score {len(continuation)} continuation tokens after {len(context)} context "
                             f"tokens with max_length {self.max_length}")
        return (context + continuation)[-(self.max_length + 1):][:-1], continuation

    @torch.no_grad()
    def _score_rows(self, rows: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """One forward over right-padded ``rows``; causal attention keeps the padding out of every
        real position, so each row is scored as if alone."""
        width = max(len(inp) for inp, _ in rows)
        ids = torch.tensor([inp + [0] * (width - len(inp)) for inp, _ in rows], device=self._device)
        logits = self.model(ids)
        out = []
        for row, (inp, cont) in zip(logits, rows):
            # Position t predicts token t + 1: the continuation is predicted by the last len(cont) inputs.
            logprobs = torch.log_softmax(row[len(inp) - len(cont):len(inp)].float(), dim=-1)
            target = torch.tensor(cont, device=logprobs.device)
            total = logprobs.gather(-1, target[:, None]).sum()
            out.append((float(total), bool((logprobs.argmax(-1) == target).all())))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each document's log-likelihood over lm-eval's disjoint rolling windows of ``max_length``
        tokens (every token predicted once, the first from ``prefix_token_id``)."""
        windows, owners = [], []
        for n, (text,) in enumerate(req.args for req in requests):
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owners.append(n)
        totals = [0.0] * len(requests)
        for n, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm)):
            totals[n] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # --- generation ---------------------------------------------------------------------------

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        for req in tqdm(requests, disable=disable_tqdm, desc="qcompile: generate_until requests"):
            context, gen_kwargs = req.args
            text = self._generate(context, gen_kwargs)
            self.cache_hook.add_partial("generate_until", req.args, text)
            out.append(text)
        return out

    def _generate(self, context: str, gen_kwargs: dict) -> str:
        """The continuation of ``context``, cut at the first stop string (EOS's text among them)."""
        kwargs = dict(normalize_gen_kwargs(gen_kwargs, self.max_gen_toks))
        stop = handle_stop_sequences(kwargs.pop("until", None), eos=self.tok_decode([self.eot_token_id], False))
        max_new = kwargs.pop("max_gen_toks")
        params, seed = self._sampling(kwargs, max_new)
        if max_new >= self.max_length:
            raise ValueError(f"max_gen_toks {max_new} leaves no room for a context within max_length {self.max_length}")
        # An empty context starts from the prefix token, as loglikelihood's does.
        ids = self.tok_encode(context, left_truncate_len=self.max_length - max_new) or [self.prefix_token_id]
        # A request's own seed, else torch's global generator (lm-eval seeds it), which moves on between
        # requests, so that repeated sampled requests differ.
        generator = torch.default_generator if seed is None else torch.Generator().manual_seed(seed)
        return postprocess_generated_text(self._decode(ids, params, stop, generator), stop, None)

    def _sampling(self, kwargs: dict, max_new: int) -> tuple[SamplingParams, int | None]:
        """lm-eval's normalized generation kwargs as the engine's sampling settings; anything else
        (``repetition_penalty``, …) is refused rather than ignored."""
        do_sample = kwargs.pop("do_sample", False)
        temperature = float(kwargs.pop("temperature", 1.0 if do_sample else 0.0))
        extra = {k: kwargs.pop(k) for k in SAMPLING_KEYS if k in kwargs}
        if kwargs:
            raise ValueError(f"generation kwargs the qcompile model does not take: {sorted(kwargs)}")
        params = SamplingParams(max_tokens=max_new, temperature=temperature if do_sample else 0.0,
                                top_k=int(extra.get("top_k", 0)), top_p=float(extra.get("top_p", 1.0)))
        return params, None if extra.get("seed") is None else int(extra["seed"])

    @torch.no_grad()
    def _decode(self, ids: list[int], params: SamplingParams, stop: list[str], generator: torch.Generator) -> str:
        """Tokens after ``ids`` until EOS, a stop string or ``params.max_tokens``: the reference decoder
        through the token loop every runtime shares (``serving/reference.py``); returns their text."""
        decoder = ReferenceDecoder(self.model, len(ids) + params.max_tokens)
        eos = [*self.model.config.eos_token_ids, self.eot_token_id]
        request = Request("lm-eval", ids, replace(params, stop=tuple(s for s in stop if s)), eos, self.tokenizer,
                          generator=generator)
        for _ in token_events(decoder, request):
            pass
        return request.text


def _load(pretrained, dtype: str, allow_pickle: bool):
    """A ``LoadedModel`` as given, else ``qcompile.load``'s (pickled checkpoints only when asked)."""
    from compiler.io.types import LoadedModel
    from qcompile import load

    return pretrained if isinstance(pretrained, LoadedModel) else load(pretrained, dtype, allow_pickle)


def _device(name: str | None) -> torch.device:
    """``name``, else CUDA when available, else the CPU. lm-eval's CLI passes ``cuda:0`` unless told
    otherwise, so a CUDA device without CUDA falls back to the CPU, as lm-eval's ``hf`` model does."""
    if name is None or (name.startswith("cuda") and not torch.cuda.is_available()):
        if name is not None:
            log.warning("qcompile model: device %s is not available; using the CPU", name)
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _batch_size(value: int | str) -> int:
    """lm-eval's CLI passes ``--batch_size`` as text; "auto" (its probe for the largest batch that
    fits a GPU) becomes 1 here."""
    text = str(value)
    if text.startswith("auto"):
        log.warning("qcompile model: batch_size %s is not supported; using 1", text)
        return 1
    return int(text)


def main() -> None:
    """lm-eval's command line with the ``qcompile`` model registered (it is, by this module's import)."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
