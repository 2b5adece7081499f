"""The wire protocol: the names of every record and key that crosses the wire (how tensors
become records is common/codec.py).

Every train message carries ``arrays`` (the model the clients start from: the global model,
or the strategy's ``start_point``, e.g. FedACG's look-ahead theta + lambda m) and ``config``
(``server-round``, ``nonce``, ``state-round``: the client's last accepted round), plus the
extra ArrayRecords its algorithm declares in strategies/registry.py (``down``) and its scalars
in ``config`` (``values``: FedGF's c, FedWMSAM's alpha). Every train reply
carries ``arrays`` (the local model after training), ``metrics`` (num-examples, num-steps,
train-loss, and optional self-reports), ``config`` (partition-id and the echoed nonce: every
reply's bookkeeping, kept out of the metrics a stock Flower strategy would average) and the
algorithm's ``up`` records. Learning rates are not sent: each client derives the round's lr from
the run config and ``server-round``. docs/protocol.md writes the whole protocol out for a
ClientApp of one's own.
"""

from __future__ import annotations

# Record names. One constant per name, so a typo is an import error, not a silent miss.
MODEL = "arrays"
CONFIG = "config"
METRICS = "metrics"
GLOBAL_UPDATE = "global_update"  # FedCM / MoFedSAM / FedTOGA: the server's global update Delta
EMA_MODEL = "ema_model"  # FedGMT: the server's EMA ("trajectory") model e
MOMENTUM = "server_momentum"  # FedNSAM: the server's Nesterov momentum m
CONTROL = "control_variate"  # SCAFFOLD family: the server control variate c
GLOBAL_PERTURBATION = "global_perturbation"  # FedSMOO: the server's global perturbation s
MOMENTUM_CONTROL = "momentum_control"  # FedMoSWA: the server's momentum control variate m
PERTURBED_GLOBAL = "perturbed_global"  # FedGF: the perturbed global model w~ = w + rho_g unit(w_prev - w)

# Uploads besides the local model.
CONTROL_DELTA = "control_delta"  # SCAFFOLD family: c_i^+ - c_i
PERTURBATION_CORRECTION = "perturbation_correction"  # FedSMOO: s~_i = mu_i - s^_{i,K}
CONTROL_OFFSET = "control_offset"  # FedMoSWA: c_i^+ - m

# Server-side state (never sent) and client-side state (``context.state``) record names.
DUAL = "dual"  # FedDyn family: server dual h / client dual h_i (FedGMT: u, u_m)
CLIENT_EMA = "ema"  # FedGMT-v2: the client's own EMA model e_m
CLIENT_CONTROL = "control"  # SCAFFOLD family: the client control variate c_i
PERTURBATION_DUAL = "perturbation_dual"  # FedSMOO: the client's perturbation dual mu_i
LOCAL_BUFFERS = "local_buffers"  # buffers = local: the client's own buffers (BatchNorm statistics), FedBN-style
PREVIOUS_GLOBAL = "previous_global"  # FedLESAM: the global model of the client's last round
ADAPTIVE_M = "adaptive_m"  # FedAdam / FedYogi: server first moment
ADAPTIVE_V = "adaptive_v"  # FedAdam / FedYogi: server second moment
CONTROL_UPDATES = "control_updates"  # FedMoSWA: how many times the server has moved m (one 0-d tensor)
PSEUDO_GRADIENT = "pseudo_gradient"  # FedGloSS: the server's last pseudo-gradient, its next ascent direction
DIVERGENCE_WINDOW = "divergence_window"  # FedGF: 1 per recent round whose divergence D > T_D, else 0 (-1: empty)
GRADIENT_WEIGHT = "gradient_weight"  # FedWMSAM: the server's alpha (one 0-d tensor)

# Scalars a train message's config carries down for the algorithms that declare them
# (registry ``values``): the client rule reads them as Python floats.
MIX_WEIGHT = "mix-weight"  # FedGF: c, the weight of the perturbed global model in the gradient point
LOCAL_WEIGHT = "local-weight"  # FedWMSAM: alpha, the weight of the local gradient against the momentum
LOCAL_RADIUS = "local-radius"  # FedGloSS: this round's client SAM radius (its warm-up schedule)

# Keys inside the records (a message's wire vocabulary, used by both sides).
SERVER_ROUND = "server-round"  # config: the round this message belongs to
NONCE = "nonce"  # config: a fresh random number per round; every reply's config echoes it
STATE_ROUND = "state-round"  # config of a train message: the client's last round the server accepted
SAMPLED_CLIENTS = "sampled-clients"  # config of a train message under DP: M, the clients sampled this round
NUM_EXAMPLES = "num-examples"  # metrics: the client's examples (the server checks it against its own)
NUM_STEPS = "num-steps"  # metrics of a train reply: local steps run
TRAIN_LOSS = "train-loss"  # metrics of a train reply: mean local training loss
PARTITION_ID = "partition-id"  # a reply's config: the partition the client holds
NUM_PARTITIONS = "num-partitions"  # metrics of a handshake reply: the N the node was configured for
# metrics of a handshake reply, where the client holds data out of training: that set's size (what
# its evaluate replies must claim as num-examples, and federated evaluation's weight)
NUM_HELDOUT = "num-heldout"
EVAL_LOSS = "eval-loss"  # metrics of an evaluate reply
EVAL_ACCURACY = "eval-accuracy"  # metrics of an evaluate reply
NODE = "node"  # a handshake reply's ConfigRecord: what the node runs on (not used by the server)
# A handshake query's ConfigRecord: the server's values of the run-config keys both halves must
# agree on (SHARED_KEYS, and the keys its algorithm's client half reads). A flatflower ClientApp
# compares them with its own run config and answers a difference with an error naming the keys
# (SETTINGS_DIFFER ...), which the server shows as the node's refusal; a ClientApp that does not
# read it (a stock one, an older one) answers as before, and a query without it is not compared.
SETTINGS = "settings"
SETTINGS_DIFFER = "the clients' run config differs from the server's on"  # how that error begins
# The general run-config keys a client reads that the server's checks and aggregation rely on:
# what model it builds, which data and partition it holds, how it trains and privatizes. Never
# the keys that may differ per node (data-dir, download: a node's node config may override
# them), the server's own (rounds, sampling, aggregation, run-dir, ...), nor the engine's
# (eval-batch-size, batching, compile, client-eval, client-state-dir, checkpoint-every).
SHARED_KEYS = (
    "algorithm", "seed", "dataset", "model", "buffers", "input-shape", "num-classes", "classes",
    "image-size", "csv-label", "partition", "partition-args", "partition-seed", "dirichlet-alpha",
    "classes-per-client", "validation-fraction", "synthetic-alpha", "synthetic-beta",
    "lr", "lr-decay", "local-epochs", "local-steps", "batch-size", "weight-decay", "momentum",
    "clip-norm", "amp", "train-transform", "dp.clip", "dp.noise-multiplier", "dp.clip-mode",
)
DEVICE = "device"  # NODE's one key: the torch device the client trains on
# ``client-eval`` self-reports a train reply may add (checked, written to clients.jsonl, never
# aggregated): "<measure>-before" / "<measure>-after" training, for each measure.
SELF_REPORT_MEASURES = ("loss", "accuracy", "heldout-accuracy")
SELF_REPORTS = tuple(f"{m}-{when}" for m in SELF_REPORT_MEASURES for when in ("before", "after"))


def self_report_key(measure: str, when: str) -> str:
    """The metric name of a self-report: ``loss-before``, ``heldout-accuracy-after``, ..."""
    key = f"{measure}-{when}"
    if key not in SELF_REPORTS:
        raise ValueError(f"no self-report {key!r}; the protocol has {', '.join(SELF_REPORTS)}")
    return key
