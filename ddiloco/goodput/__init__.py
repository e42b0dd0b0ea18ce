"""ddiloco.goodput: the fleet-scale goodput and bandwidth model behind `ddiloco-goodput` (docs/goodput.md).

Analytic and Monte Carlo: no training, no learners. `model` holds the configuration, `job` one
synchronous job's reaction to failures, `fleet` the fleet simulator, `bandwidth` the cross-site
bandwidth model, `report` the studies' tables and plots.
"""
