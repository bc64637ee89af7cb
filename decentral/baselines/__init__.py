"""Baselines our protocols are measured against: the same model, data and inner optimizer as
`decentral train`, synchronised by another library instead of by `decentral.sync`.

`python -m decentral.baselines.hivemind_optimizer`: `hivemind.Optimizer` with local updates and
periodic parameter averaging, configured as hivemind's documentation recommends for a few peers on
slow links. It writes the same `metrics.jsonl` fields as `decentral.worker`.
"""
