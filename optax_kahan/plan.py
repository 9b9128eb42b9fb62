"""``python -m optax_kahan.plan``: which streamed layout fits a card and the
host RAM fastest, for a named model's shapes (no weights needed).

    python -m optax_kahan.plan --model flux-dev --card 16 --host-ram 64

For your own model, call ``optax_kahan.blockwise.plan``. See
docs/guides/flux.md.
"""

from optax_kahan._src.plan_command import default_tx
from optax_kahan._src.plan_command import image_tokens
from optax_kahan._src.plan_command import main
from optax_kahan._src.plan_command import model_plans
from optax_kahan._src.plan_command import MODELS
from optax_kahan._src.plan_command import OPTIMIZER
from optax_kahan._src.plan_command import summary

__all__ = ("MODELS", "OPTIMIZER", "default_tx", "image_tokens", "main",
           "model_plans", "summary")

if __name__ == "__main__":
  main()
