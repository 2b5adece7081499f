"""Flower Datasets' partitioners as an optional partition backend: ``partition = "fds:<Name>"``.

Any class of ``flwr_datasets.partitioner`` (``fds:DirichletPartitioner``,
``fds:PathologicalPartitioner``, ``fds:ShardPartitioner``, ...), with its keyword arguments in
``partition-args`` (``"alpha=0.5, min_partition_size=5"``: values read as TOML scalars or
arrays, a bare word as text). The run fills in what it owns when the partitioner takes it:
``num_partitions`` (the run's N), ``partition_by = "label"`` and ``seed`` (the run's data seed,
so a seeded run draws the same partition on every node).

The partitioner runs on a Hugging Face ``datasets.Dataset`` of the training labels and an
index column; the index arrays of its partitions plug into the same path as flatflower's own
schemes (common/partition.py): every node computes them, the server records them in
partition.json. flatflower's own schemes stay the default; Flower Datasets is an extra
(``pip install 'flatflower[fds]'``), imported only when a run names it.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

import numpy as np

PREFIX = "fds:"
_OWNED = ("num_partitions",)  # set by the run, never by partition-args
_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def is_fds(scheme: str) -> bool:
    """Whether ``partition`` names a Flower Datasets partitioner."""
    return isinstance(scheme, str) and scheme.startswith(PREFIX)


def parse_args(text: str) -> dict[str, Any]:
    """``"alpha=0.5, partition_by=label, alpha=[0.1, 0.2]"`` -> keyword arguments; ValueError
    (one line) when an item is not ``key=value`` or a key repeats."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    out: dict[str, Any] = {}
    for item in _split_top_level(text):
        if not item.strip():
            continue
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not _KEY.match(key):
            raise ValueError(f"partition-args={text!r}: {item.strip()!r} is not key=value (a Python keyword name)")
        if key in out:
            raise ValueError(f"partition-args={text!r}: {key!r} is given twice")
        try:
            out[key] = tomllib.loads(f"v = {raw.strip()}")["v"]
        except (ValueError, tomllib.TOMLDecodeError):
            if not _KEY.match(raw.strip()):
                raise ValueError(f"partition-args={text!r}: the value of {key!r} ({raw.strip()!r}) is neither "
                                 "a TOML value nor a bare word") from None
            out[key] = raw.strip()  # a bare word: partition_by=label
    return out


def _split_top_level(text: str) -> list[str]:
    """``text`` split at the commas outside brackets and quotes."""
    items, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(text):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return items


def problems(scheme: str, args: str) -> list[str]:
    """What is wrong with ``partition`` / ``partition-args`` as text (without importing Flower
    Datasets: a run config is parsed at every client call)."""
    out = []
    if is_fds(scheme):
        if not _KEY.match(scheme[len(PREFIX):]):
            out.append(f"partition={scheme!r}: name a class of flwr_datasets.partitioner after 'fds:' "
                       "(e.g. fds:DirichletPartitioner)")
        try:
            given = parse_args(args)
        except ValueError as err:
            return out + [str(err)]
        owned = [k for k in _OWNED if k in given]
        if owned:
            out.append(f"partition-args: {owned[0]} is set by the run (num-partitions, or the nodes connected)")
    elif args.strip():
        out.append(f"partition-args={args!r} is read only by partition = fds:<Partitioner>, not {scheme!r}")
    return out


def partition(labels: np.ndarray, num_partitions: int, scheme: str, args: str, seed: int) -> list[np.ndarray]:
    """Indices into ``labels`` of each partition drawn by Flower Datasets' partitioner
    ``scheme`` (``fds:<Name>``): disjoint, sorted int64 arrays (a partitioner may leave samples
    out, as ShardPartitioner does with an incomplete shard). PartitionError, one line, when
    flwr-datasets is missing, the partitioner is unknown or refuses its arguments."""
    import difflib

    from flatflower.common.partition import PartitionError

    try:
        import datasets as hf
        import flwr_datasets.partitioner as fdp
    except ImportError:
        raise PartitionError(f"partition={scheme!r} needs Flower Datasets, which is not installed here: "
                             "pip install 'flatflower[fds]'") from None
    if not 1 <= num_partitions <= len(labels):
        raise PartitionError(f"the number of clients (num-partitions, --clients) must be between 1 and "
                             f"the number of samples ({len(labels)}), got {num_partitions}")
    name = scheme[len(PREFIX):]
    names = sorted(n for n in dir(fdp) if n.endswith("Partitioner") and n != "Partitioner")
    cls = getattr(fdp, name, None)
    if name not in names or not isinstance(cls, type):
        close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
        raise PartitionError(f"partition={scheme!r}: flwr_datasets.partitioner has no {name!r}"
                             f"{f' (did you mean {close[0]!r}?)' if close else ''}; its partitioners: {', '.join(names)}")
    try:
        kwargs = parse_args(args)
    except ValueError as err:
        raise PartitionError(str(err)) from None
    params = inspect.signature(cls.__init__).parameters
    filled = {"num_partitions": num_partitions, "partition_by": "label", "seed": seed}
    for key, value in filled.items():
        if key in params:
            kwargs.setdefault(key, value)
    labels = np.asarray(labels, dtype=np.int64)
    was_enabled = hf.utils.logging.is_progress_bar_enabled()
    hf.utils.logging.disable_progress_bar()
    try:
        table = hf.Dataset.from_dict({"label": labels, "index": np.arange(len(labels), dtype=np.int64)})
        partitioner = cls(**kwargs)
        partitioner.dataset = table
        count = partitioner.num_partitions
        if count != num_partitions:
            raise ValueError(f"it makes {count} partitions, the run has {num_partitions}")
        parts = [np.sort(np.asarray(partitioner.load_partition(i)["index"], dtype=np.int64))
                 for i in range(count)]
    except (TypeError, ValueError, KeyError, IndexError) as err:
        first = str(err).splitlines()[0][:240] if str(err) else type(err).__name__
        raise PartitionError(f"partition={scheme!r} with partition-args={args!r}: {first}") from None
    finally:
        if was_enabled:
            hf.utils.logging.enable_progress_bar()
    if sum(len(p) for p in parts) != len(np.unique(np.concatenate(parts))):
        raise PartitionError(f"partition={scheme!r}: its partitions overlap (a sample on two clients)")
    return parts
