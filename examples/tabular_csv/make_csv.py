"""Write a tabular dataset as two CSV files, offline: OUT/train.csv and OUT/test.csv, a header
row, 30 numeric feature columns and a ``label`` column (0 malignant, 1 benign).

The data is scikit-learn's bundled Wisconsin breast-cancer table (569 rows), each feature
standardised with the training rows' mean and standard deviation. Stand-in for your own table:
any CSV with a header, numeric features and an integer label column works
(``csv-label`` names the label column). Usage: python make_csv.py OUT
"""

import argparse
from pathlib import Path

import numpy as np
from sklearn.datasets import load_breast_cancer


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out")
    args = parser.parse_args(argv)
    table = load_breast_cancer()
    order = np.random.default_rng(0).permutation(len(table.target))
    cut = int(0.8 * len(order))
    train, test = order[:cut], order[cut:]
    mean, std = table.data[train].mean(axis=0), table.data[train].std(axis=0)
    names = [f"f{j}" for j in range(table.data.shape[1])]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for split, rows in (("train", train), ("test", test)):
        values = np.column_stack([(table.data[rows] - mean) / std, table.target[rows]])
        np.savetxt(out / f"{split}.csv", values, delimiter=",", header=",".join(names + ["label"]),
                   comments="", fmt=["%.6f"] * len(names) + ["%d"])
    print(f"wrote {out}/train.csv ({len(train)} rows) and {out}/test.csv ({len(test)} rows)")


if __name__ == "__main__":
    main()
