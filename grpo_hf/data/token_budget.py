"""A generation round's rows by tokens (`token_budget`): cut into log-prob passes of consecutive rows
(`budget_passes`, `rows_in_passes`) and dealt to processes (`balance_rows`). Pure functions of
per-row token counts; `training.logprob_passes` runs them."""


def budget_passes(tokens: list[int], budget: int) -> int:
    """How many passes of consecutive rows, of at most `budget` tokens each, `tokens` (one count per
    row) needs at least (filled greedily; a row over the budget makes a pass of its own)."""
    passes, load = 0, budget
    for count in tokens:
        if load + count > budget:
            passes, load = passes + 1, 0
        load += count
    return passes


def rows_in_passes(tokens: list[int], passes: int) -> list[slice]:
    """The rows cut into exactly `passes` runs of consecutive rows (1 <= passes <= rows) whose largest
    token count is as small as can be: the least cap that `budget_passes` fits into `passes`
    (bisected), filled greedily, then the run with most rows halved until there are `passes`."""
    low, high = max(tokens), sum(tokens)
    while low < high:
        cap = (low + high) // 2
        low, high = (low, cap) if budget_passes(tokens, cap) <= passes else (cap + 1, high)
    runs, start, load = [], 0, 0
    for row, count in enumerate(tokens):
        if row > start and load + count > low:
            runs.append(slice(start, row))
            start, load = row, 0
        load += count
    runs.append(slice(start, len(tokens)))
    while len(runs) < passes:  # too few rows per cap for `passes` runs: split the longest by rows
        i = max(range(len(runs)), key=lambda j: runs[j].stop - runs[j].start)
        middle = (runs[i].start + runs[i].stop) // 2
        runs[i : i + 1] = [slice(runs[i].start, middle), slice(middle, runs[i].stop)]
    return runs


def balance_rows(tokens: list[list[int]], step_rows: int) -> list[list[int]]:
    """Which rows each process takes so that the processes' shares of each optimizer step hold about as
    many tokens each, with as many rows each as before.

    `tokens[p][r]`: the tokens of process p's row r (R rows each; each run of `step_rows` of them feeds
    one optimizer step). Returns each process's R rows as global indices (p * R + r): a step's rows
    before the next step's, each step's in global order (a prompt's copies stay side by side). Greedy,
    the same on every process: a step's rows by tokens, most first (ties: lower index), each to the
    process with the fewest tokens so far that still has room (ties: lower process).
    """
    processes, rows = len(tokens), len(tokens[0])
    taken: list[list[int]] = [[] for _ in range(processes)]
    for start in range(0, rows, step_rows):
        pool = [
            (tokens[p][r], p * rows + r) for p in range(processes) for r in range(start, start + step_rows)
        ]
        loads, shares = [0] * processes, [[] for _ in range(processes)]
        for count, row in sorted(pool, key=lambda item: (-item[0], item[1])):
            p = min((q for q in range(processes) if len(shares[q]) < step_rows), key=lambda q: (loads[q], q))
            shares[p].append(row)
            loads[p] += count
        for p in range(processes):
            taken[p] += sorted(shares[p])
    return taken
