"""Deployment contracts shared by passes, backends and serving: the target registry, each target what
it can run and its lowering (``targets.py``), ``lower`` (``lowering.py``) and the serving plan
(``serving_plan.py``)."""
