"""What verifying a chain costs at a long context: one forward over ``n`` rows (the root and
``n - 1`` drafted tokens) after ~8k cached tokens, on the usual runner and on the reproducible one
(median of 5; the entries are rolled back after each forward).

    .venv/bin/python benchmarks/verify_rows_cost.py [--context 8000] [--rows 1,2,4,7]
"""

import argparse
import time

from speculum import load
from speculum.runners import runner_for
from speculum.tree import DraftTree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=8000)
    ap.add_argument("--rows", default="1,2,4,7")
    args = ap.parse_args()
    model, _ = load("default", "bfloat16")
    plain = runner_for(model)
    ids = [100 + i % 5000 for i in range(args.context)]
    print("| runner | " + " | ".join(f"{n} rows ms" for n in args.rows.split(",")) + " |")
    print("|---|" + "---:|" * len(args.rows.split(",")))
    for name, runner in (("usual", plain), ("reproducible", plain.invariant())):
        cache = runner.new_cache(args.context + 100)
        runner.prefill(cache, ids)
        length, cells = cache.length, []
        for n in map(int, args.rows.split(",")):
            tree, times = DraftTree.chain(list(range(200, 199 + n))), []
            for _ in range(5):
                t = time.perf_counter()
                runner.forward(cache, 5, tree)
                times.append(time.perf_counter() - t)
                cache.commit([0])
                cache.rollback(length)
            cells.append(f"{1e3 * sorted(times)[2]:.1f}")
        print(f"| {name} | " + " | ".join(cells) + " |")
        del cache


if __name__ == "__main__":
    main()
