"""The flatness measures' settings (common/flatness.py), without PyTorch: the command line
offers them (``flatflower flatness --help``) before PyTorch loads."""

HVP_METHODS = ("func", "double-backward")
DEFAULT_RHO, DEFAULT_ITERS, DEFAULT_PROBES = 0.05, 20, 10
TOLERANCE = 1e-4  # power iteration stops once the eigenvalue's relative change is below this
