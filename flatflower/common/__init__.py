"""What the server and client sides share, importing neither: the run config (config.py) and
the algorithms' params mechanics (params.py), ``package.module:callable`` references
(references.py), tensor arithmetic of both halves (tensors.py), the wire protocol's names
(protocol.py) and its array encoding (codec.py), the model zoo and the user's models
(models.py), the datasets (datasets.py, splits.py, userdata.py, fds.py), partitions (partition.py,
data.py), augmentation (augment.py), evaluation (evaluate.py), flatness measures (flatness.py),
client-level differential privacy (privacy.py), file-structure checks (schema.py) and the
opt-in patch of Flower's waits (fastpoll.py)."""
