"""Write three sites' own data, as three hospitals would hold it: OUT/site0, OUT/site1, OUT/site2,
each with train.npz and test.npz (arrays ``x`` and ``y``), of different sizes and class mixes.

From scikit-learn's bundled 8x8 digits (offline): site 0 holds mostly digits 0-3, site 1
mostly 4-6, site 2 mostly 7-9, each with a few of every other class, and site 2 the most
images. No site's folder is ever read by another machine: each SuperNode is pointed at its own.
Usage: python make_sites.py OUT
"""

import argparse
from pathlib import Path

import numpy as np
from sklearn.datasets import load_digits

SITES = {"site0": ((0, 1, 2, 3), 0.15), "site1": ((4, 5, 6), 0.2), "site2": ((7, 8, 9), 0.35)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out")
    args = parser.parse_args(argv)
    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[:, None]  # (N, 1, 8, 8)
    y = digits.target.astype(np.int64)
    rng = np.random.default_rng(0)
    order = rng.permutation(len(y))
    taken = np.zeros(len(y), dtype=bool)
    for site, (major, share) in SITES.items():
        mine = [i for i in order if not taken[i] and (y[i] in major or rng.random() < 0.08)]
        mine = np.array(mine[: int(share * len(y))])
        taken[mine] = True
        cut = int(0.8 * len(mine))
        folder = Path(args.out) / site
        folder.mkdir(parents=True, exist_ok=True)
        np.savez(folder / "train.npz", x=x[mine[:cut]], y=y[mine[:cut]])
        np.savez(folder / "test.npz", x=x[mine[cut:]], y=y[mine[cut:]])
        counts = np.bincount(y[mine], minlength=10)
        print(f"{folder}: {cut} training and {len(mine) - cut} held-out images; per class {counts.tolist()}")


if __name__ == "__main__":
    main()
