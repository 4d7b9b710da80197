"""Deployment contracts shared by passes, backends and serving: what each target can run
(``targets.py``), the lowering registry (``lowering.py``) and the serving plan (``serving_plan.py``)."""
