"""Grade-school word problems in GSM8K's format, built offline and deterministically.

    python -m common.word_problems data/word_problems      # writes train.jsonl (2000), test.jsonl (200), transfer.jsonl (200)

Each row is {"question": ..., "answer": ...} as in openai/gsm8k: the answer is a worked solution, one
arithmetic step per line, ending in `#### N`. Problems take 1 to 3 steps (+, -, x, /) over small whole
numbers, from templates with names, objects and numbers drawn from a fixed seed; every intermediate and
final result is a whole number >= 0. The held-out questions never occur in the training file. They are
read by the real GSM8K path: `--task gsm8k --data-path train.jsonl --eval-data-path test.jsonl`.

transfer.jsonl is a second held-out set from an independent generator (transfer_problem): other situations and
words (floors and windows, tanks and litres, ropes, tickets, classes), and other step structures - the sequences
of operations (-, +), (-, -), (+, +), (/, -), (/, x), (-, x), (x, x), (x, x, +), (x, x, -), none of which the
training generator produces (a test checks both). It measures whether what RL teaches transfers beyond the
training templates: `--extra-eval-data-path data/word_problems/transfer.jsonl`.
"""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

NAMES = ["Tom", "Anna", "Ben", "Maria", "Sam", "Lily", "Omar", "Grace", "Leo", "Nina", "Raj", "Emma", "Jack", "Zoe",
         "Ivan", "Mia", "Noah", "Ava", "Kofi", "Sara"]
OBJECTS = ["apples", "pencils", "stickers", "marbles", "cookies", "books", "shells", "cards", "stamps", "oranges",
           "balloons", "coins", "flowers", "toy cars", "eggs"]
CONTAINERS = ["boxes", "bags", "packs", "jars", "baskets", "crates"]


def _one_step(r: random.Random, name: str, obj: str) -> tuple[str, list[str], int]:
    a, b = r.randint(2, 20), r.randint(2, 20)
    kind = r.choice(["add", "sub", "mul", "div"])
    if kind == "add":
        return (f"{name} has {a} {obj}. {name} gets {b} more {obj}. How many {obj} does {name} have now?",
                [f"{name} has {a} + {b} = {a + b} {obj}."], a + b)
    if kind == "sub":
        a, b = max(a, b) + 1, min(a, b)
        return (f"{name} had {a} {obj} and gave {b} of them away. How many {obj} does {name} have left?",
                [f"{name} has {a} - {b} = {a - b} {obj} left."], a - b)
    container = r.choice(CONTAINERS)
    a, b = r.randint(2, 9), r.randint(2, 12)
    if kind == "mul":
        return (f"{name} buys {a} {container} of {obj}. Each of them holds {b} {obj}. How many {obj} does {name} buy?",
                [f"{name} buys {a} x {b} = {a * b} {obj}."], a * b)
    return (f"{name} shares {a * b} {obj} equally among {a} friends. How many {obj} does each friend get?",
            [f"Each friend gets {a * b} / {a} = {b} {obj}."], b)


def _two_steps(r: random.Random, name: str, obj: str) -> tuple[str, list[str], int]:
    container = r.choice(CONTAINERS)
    a, b, c = r.randint(2, 9), r.randint(2, 10), r.randint(1, 15)
    kind = r.choice(["mul_add", "mul_sub", "add_sub", "add_mul"])
    if kind == "mul_add":
        return (f"{name} has {a} {container} with {b} {obj} in each, and {c} loose {obj}. How many {obj} does {name} have "
                "in all?", [f"The {container} hold {a} x {b} = {a * b} {obj}.", f"In all: {a * b} + {c} = {a * b + c} {obj}."],
                a * b + c)
    if kind == "mul_sub":
        c = r.randint(1, a * b - 1)
        return (f"{name} buys {a} {container} of {obj} with {b} in each and uses {c} of them. How many {obj} are left?",
                [f"{name} buys {a} x {b} = {a * b} {obj}.", f"Left: {a * b} - {c} = {a * b - c} {obj}."], a * b - c)
    if kind == "add_sub":
        a, b = r.randint(5, 30), r.randint(2, 20)
        c = r.randint(1, a + b - 1)
        return (f"{name} has {a} {obj}, finds {b} more, then loses {c}. How many {obj} does {name} have now?",
                [f"After finding: {a} + {b} = {a + b} {obj}.", f"After losing: {a + b} - {c} = {a + b - c} {obj}."],
                a + b - c)
    friend = r.choice([n for n in NAMES if n != name])
    return (f"{name} has {a} {obj} and {friend} has {b} {obj}. Each of them then triples their {obj}. How many {obj} do "
            "they have together now?", [f"Together they have {a} + {b} = {a + b} {obj}.",
                                        f"Tripled: {a + b} x 3 = {3 * (a + b)} {obj}."], 3 * (a + b))


def _three_steps(r: random.Random, name: str, obj: str) -> tuple[str, list[str], int]:
    container = r.choice(CONTAINERS)
    a, b, c = r.randint(2, 6), r.randint(2, 10), r.randint(2, 9)
    kind = r.choice(["buy_give_share", "price"])
    if kind == "buy_give_share":
        d = r.randint(2, 5)
        c += -(a * b + c) % d  # so that the total shares out evenly
        total = a * b + c
        return (f"{name} has {a} {container} of {obj} with {b} in each, and gets {c} more {obj}. {name} then shares all "
                f"the {obj} equally among {d} people. How many {obj} does each person get?",
                [f"The {container} hold {a} x {b} = {a * b} {obj}.", f"With the extra ones: {a * b} + {c} = {total} {obj}.",
                 f"Each person gets {total} / {d} = {total // d} {obj}."], total // d)
    price, n, extra = r.randint(2, 9), r.randint(2, 6), r.randint(1, 9)
    spent = price * n + extra
    paid = spent + r.randint(0, 20)
    return (f"{name} buys {n} {obj} at {price} dollars each and a bag for {extra} dollars, paying with {paid} dollars. "
            f"How many dollars of change does {name} get?",
            [f"The {obj} cost {n} x {price} = {price * n} dollars.", f"With the bag: {price * n} + {extra} = {spent} dollars.",
             f"Change: {paid} - {spent} = {paid - spent} dollars."], paid - spent)


def problem(r: random.Random) -> dict:
    """One problem: 1, 2 or 3 steps (about 40 / 35 / 25 %)."""
    name, obj = r.choice(NAMES), r.choice(OBJECTS)
    make = r.choices([_one_step, _two_steps, _three_steps], weights=[40, 35, 25])[0]
    question, steps, result = make(r, name, obj)
    return {"question": question, "answer": "\n".join(steps + [f"#### {result}"])}


def transfer_problem(r: random.Random) -> dict:
    """One problem of the transfer set: situations, phrasings and step structures the training generator never uses."""
    name = r.choice(NAMES)
    kind = r.choice(["comparison", "tank", "shelves", "half", "rope", "discount", "building", "broken_windows", "tickets"])
    if kind == "comparison":  # (-, +)
        a, b = r.randint(12, 60), r.randint(2, 11)
        q = f"A red box holds {a} marbles and a blue box holds {b} fewer. How many marbles are in the two boxes together?"
        steps = [f"The blue box holds {a} - {b} = {a - b}.", f"Together: {a} + {a - b} = {2 * a - b}."]
    elif kind == "tank":  # (-, -)
        a, b = r.randint(40, 120), r.randint(5, 20)
        c = r.randint(1, a - b - 1)
        q = f"A water tank holds {a} litres. {b} litres leak out in the morning and {c} in the afternoon. How many litres are left?"
        steps = [f"After the morning: {a} - {b} = {a - b} litres.", f"After the afternoon: {a - b} - {c} = {a - b - c} litres."]
    elif kind == "shelves":  # (+, +)
        a, b, c = (r.randint(5, 40) for _ in range(3))
        q = f"Three shelves in a library hold {a}, {b} and {c} books. How many books are on the shelves?"
        steps = [f"The first two hold {a} + {b} = {a + b}.", f"All three: {a + b} + {c} = {a + b + c}."]
    elif kind == "half":  # (/, -)
        n = 2 * r.randint(8, 20)
        k = r.randint(1, n // 2 - 1)
        q = f"A class has {n} students. Half of them walk to school and {k} of the others take the bus. How many come to school another way?"
        steps = [f"Half of the class: {n} / 2 = {n // 2} students.", f"Not by bus: {n // 2} - {k} = {n // 2 - k}."]
    elif kind == "rope":  # (/, x)
        k, piece = r.randint(2, 8), r.randint(2, 9)
        m = r.randint(1, k)
        q = f"A rope {k * piece} metres long is cut into {k} equal pieces, and {m} of the pieces are used. How many metres of rope are used?"
        steps = [f"Each piece is {k * piece} / {k} = {piece} metres.", f"Used: {m} x {piece} = {m * piece} metres."]
    elif kind == "discount":  # (-, x)
        price, off, n = r.randint(6, 20), r.randint(1, 5), r.randint(2, 9)
        q = f"A museum ticket costs {price} dollars, and {name} gets {off} dollars off each one. What does {name} pay for {n} tickets?"
        steps = [f"One ticket: {price} - {off} = {price - off} dollars.", f"{n} tickets: {n} x {price - off} = {n * (price - off)} dollars."]
    elif kind in ("building", "broken_windows"):  # (x, x) and (x, x, -)
        f, rooms, w = r.randint(2, 6), r.randint(2, 8), r.randint(2, 4)
        q = f"A building has {f} floors with {rooms} rooms on each floor, and every room has {w} windows. "
        steps = [f"Rooms: {f} x {rooms} = {f * rooms}.", f"Windows: {f * rooms} x {w} = {f * rooms * w}."]
        if kind == "building":
            q += "How many windows does the building have?"
        else:
            broken = r.randint(1, f * rooms * w - 1)
            q += f"{broken} of the windows are broken. How many windows are not broken?"
            steps.append(f"Not broken: {f * rooms * w} - {broken} = {f * rooms * w - broken}.")
    else:  # tickets: (x, x, +)
        adults, children, x, y = r.randint(1, 4), r.randint(1, 5), r.randint(8, 15), r.randint(3, 7)
        q = (f"At the zoo an adult ticket costs {x} dollars and a child ticket {y} dollars. {name} buys {adults} adult and "
             f"{children} child tickets. How many dollars is that?")
        steps = [f"Adults: {adults} x {x} = {adults * x} dollars.", f"Children: {children} x {y} = {children * y} dollars.",
                 f"In all: {adults * x} + {children * y} = {adults * x + children * y} dollars."]
    result = int(steps[-1].rsplit("= ", 1)[1].split()[0].rstrip("."))
    return {"question": q, "answer": "\n".join(steps + [f"#### {result}"])}


STEP = re.compile(r"(\d+) ([-+x/]) (\d+) = (\d+)")


def solution_steps(answer: str) -> list[tuple[int, str, int, int]]:
    """The worked solution's steps, (a, op, b, result) of each 'a op b = result' line before '#### N'."""
    *lines, _ = answer.split("\n")
    return [(int(a), op, int(b), int(c)) for a, op, b, c in (STEP.search(line).groups() for line in lines)]


def distinct(make, r: random.Random, n: int, seen: set[str]) -> list[dict]:
    """n problems make(r) whose questions are not in `seen` nor repeated (seen grows with them)."""
    rows = []
    while len(rows) < n:
        row = make(r)
        if row["question"] not in seen:
            seen.add(row["question"])
            rows.append(row)
    return rows


def build_transfer(n: int = 200, seed: int = 2) -> list[dict]:
    """n distinct transfer problems (transfer_problem), from their own seed."""
    return distinct(transfer_problem, random.Random(seed), n, set())


def build(n_train: int = 2000, n_test: int = 200, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Held-out problems first (seed), then training problems (seed + 1) that repeat none of them."""
    seen: set[str] = set()
    test = distinct(problem, random.Random(seed), n_test, seen)
    return distinct(problem, random.Random(seed + 1), n_train, seen), test


def write(directory: str | Path, n_train: int = 2000, n_test: int = 200) -> tuple[Path, Path]:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    train, test = build(n_train, n_test)
    paths = directory / "train.jsonl", directory / "test.jsonl", directory / "transfer.jsonl"
    for path, rows in zip(paths, (train, test, build_transfer(n_test))):
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return paths


if __name__ == "__main__":
    for p in write(sys.argv[1] if len(sys.argv) > 1 else "data/word_problems"):
        print(p)
