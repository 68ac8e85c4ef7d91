"""kuscale: per-node vertical autoscaling of CPU quota and GPU time share under token budgets."""

__version__ = "0.1.0"
