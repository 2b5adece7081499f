"""The conformance kit of your own algorithm (docs/check-algorithm.md), for Python.

``flatflower check-algorithm REF [--reference module:callable]`` runs it from the command line;
:func:`check_algorithm` runs it here and returns one :class:`~flatflower.tools.conformance.Check`
per check. A ``--reference`` callable receives a :class:`ReferenceProblem` (one round on
logistic regression: ``w0``, ``clients``, ``weights``, ``params``, ``lr``, ``local_steps``,
``server_lr``, ``grad``) and returns the new global model's trainable parameters as float64
numpy arrays; :func:`grad` and :func:`sam_grad` are the float64 gradients to write it with.
"""

from __future__ import annotations

from flatflower.common.reference_problem import ReferenceProblem, grad, sam_grad

__all__ = ["ReferenceProblem", "check_algorithm", "grad", "sam_grad"]


def check_algorithm(algorithm: str, reference: str | None = None, **options):
    """The kit's checks of ``algorithm`` (a built-in name or ``package.module:callable``), with
    ``reference`` (``module:callable``) for the one-round check: a list of checks, each with
    ``ok`` and its ``line``. ``options``: ``engines``, ``rounds``, ``clients``, ``work_dir``,
    ``out`` (called with each line as it is decided; default: nothing printed)
    (flatflower.tools.conformance.run_checks). ValueError when ``algorithm`` or ``reference``
    cannot be loaded."""
    from flatflower.tools.conformance import run_checks

    return run_checks(algorithm, reference=reference, **{"out": lambda line: None, **options})
