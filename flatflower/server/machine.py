"""The machine a run ran on: what can move its numbers when the code and config do not.

The same command re-makes a run bit for bit on the same machine. On another one, PyTorch's CPU
kernels (chosen by the CPU's instruction set: AVX2, AVX-512, ...), its BLAS/LAPACK and oneDNN
builds and the number of threads can sum in another order, and the numbers move from round 0
on (a test loss of 2.30688563 against 2.30688562, then accuracies a point apart). So every
run directory's config.json records, under ``machines``, the fingerprint of the machine that
ran it (:func:`fingerprint`), one entry per machine in the order they ran it (a run resumed on
another machine gets a second entry, from the round it resumed at: :func:`history`), and
``flatflower report`` says when the runs it compares come from different machines.

``id`` is a digest of the fields that can move numbers (:data:`ID_FIELDS`); ``platform`` (the
kernel release) and ``cpus`` are recorded beside them but are no part of it. A deployment's
fingerprint is the ServerApp's machine's: the clients' machines are their own.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import re
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

# the fields that make two machines "the same" for the numbers of a run
ID_FIELDS = ("arch", "cpu", "cpu_flags", "cpu_capability", "torch", "torch_config", "torch_blas",
             "torch_lapack", "mkl", "mkldnn", "numpy", "numpy_blas", "threads", "interop_threads", "cuda")


def short_digest(text: str) -> str:
    """The first 16 hex digits of the sha256 of ``text``."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _cpuinfo() -> tuple[str, str]:
    """(CPU model, digest of its sorted feature flags) from /proc/cpuinfo (Linux, x86 and Arm);
    platform.processor() and "unknown" elsewhere."""
    model, flags = "", ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key, value = key.strip().lower(), value.strip()
                if not model and key in ("model name", "cpu model", "hardware"):
                    model = value
                elif not flags and key in ("flags", "features"):
                    flags = " ".join(sorted(set(value.split())))
    except OSError:
        pass
    return model or platform.processor() or "unknown", short_digest(flags) if flags else "unknown"


def _build_setting(config: str, name: str) -> str:
    """One ``NAME=value`` of torch.__config__.show()'s build settings ("unknown" if absent)."""
    match = re.search(rf"\b{name}=([^,\s]*)", config)
    return match.group(1) if match else "unknown"


def _numpy_blas() -> str:
    """numpy's BLAS: its name and version as numpy's build records them."""
    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        return f"{blas.get('name', 'unknown')} {blas.get('version', '')}".strip()
    except (TypeError, KeyError, AttributeError):  # an older numpy: no dicts mode
        return "unknown"


@functools.cache
def _static() -> dict[str, Any]:
    """What does not change while a process runs (read once)."""
    config = torch.__config__.show()
    mkldnn = re.search(r"MKL-DNN (v[\d.]+)", config)
    cpu, flags = _cpuinfo()
    return {
        "arch": platform.machine(), "cpu": cpu, "cpu_flags": flags,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__, "torch_config": short_digest(config),
        "torch_blas": _build_setting(config, "BLAS_INFO"), "torch_lapack": _build_setting(config, "LAPACK_INFO"),
        "mkl": torch.backends.mkl.is_available(),
        "mkldnn": mkldnn.group(1) if mkldnn and torch.backends.mkldnn.is_available() else False,
        "numpy": np.__version__, "numpy_blas": _numpy_blas(),
        "platform": platform.platform(), "cpus": os.cpu_count(),
    }


def fingerprint(device: torch.device | str | None = None) -> dict[str, Any]:
    """This machine as it runs now: :func:`_static`, torch's intra-op and inter-op threads
    and, where ``device`` is a CUDA device, its name and the CUDA and cuDNN versions; ``id``
    the digest of :data:`ID_FIELDS`."""
    out = {**_static(), "threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads(),
           "cuda": None}
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda":
        out["cuda"] = {"device": torch.cuda.get_device_name(device), "cuda": torch.version.cuda,
                       "cudnn": torch.backends.cudnn.version()}
    return {"id": machine_id(out), **out}


def machine_id(record: Mapping[str, Any]) -> str:
    """The digest of a fingerprint's :data:`ID_FIELDS`."""
    return short_digest(json.dumps({key: record.get(key) for key in ID_FIELDS}, sort_keys=True))


def describe(record: Mapping[str, Any]) -> str:
    """One line naming a fingerprint: ``AMD EPYC, AVX512, torch 2.14.1, threads 2 (id 1a2b...)``."""
    cuda = record.get("cuda")
    gpu = f", {cuda.get('device')}" if isinstance(cuda, dict) else ""
    return (f"{record.get('cpu', '?')}, {record.get('cpu_capability', '?')}, torch {record.get('torch', '?')}, "
            f"threads {record.get('threads', '?')}{gpu} (id {record.get('id', '?')})")


def history(previous: Any, current: Mapping[str, Any], first_round: int) -> list[dict[str, Any]]:
    """config.json's ``machines`` after a run (re)starts at ``first_round`` on ``current``:
    the previous list (a resume's; entries that are not fingerprints dropped) with ``current``
    appended unless it is the machine of the last entry (then the list as it was, so that a
    resume on the same machine leaves config.json as it was)."""
    kept = [dict(m) for m in previous if isinstance(m, dict) and isinstance(m.get("id"), str)] \
        if isinstance(previous, list) else []
    if kept and kept[-1]["id"] == current["id"]:
        return kept
    return [*kept, {"from_round": first_round, **current}]
