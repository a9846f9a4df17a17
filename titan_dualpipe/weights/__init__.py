"""Weight gradients: how an ``I`` leaves them to its ``W``, and how a full backward computes them
while its exchanges fly.

- :mod:`.policy`: what a schedule holds (which stages defer) and each step's plan;
- :mod:`.plan`: how each ``I``, ``W`` and ``B`` runs (deferred, collected, whole, torch's split);
- :mod:`.linear`, :mod:`.experts`: the deferrable GEMMs of ``nn.Linear`` and expert layers;
- :mod:`.install`: which modules defer, routed to a queue; :mod:`.queue`: the queue itself;
- :mod:`.in_flight`: the work a backward sets aside for its exchanges.

docs/weight_gradients.md is the reference.
"""

from .install import register_expert_class, uninstall
from .plan import register_whole_backward_rule
from .policy import WEIGHT_GRADIENT_MODES, WeightGradients

__all__ = ["WEIGHT_GRADIENT_MODES", "WeightGradients", "register_expert_class", "register_whole_backward_rule",
           "uninstall"]
