"""MMK12 data (parquet and JSONL, strict loading), the mmk12 reward through real math-verify, and the K12
generator."""

import io
import json
import subprocess
import sys
import threading
import time
from fractions import Fraction

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from omnirl.config import REPO_ROOT
from omnirl.data.mmk12 import PROMPT_TEMPLATE, load_mmk12
from omnirl.errors import DataError
from omnirl.models.base import Output
from omnirl.rewards import get_reward
from omnirl.rewards.mmk12 import Mmk12Reward, last_boxed, option_letter
from omnirl.rewards.pool import RewardPool


def png(color, size=(8, 6)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def reward():
    r = Mmk12Reward()
    yield r
    r.close()


def test_parquet_images_as_bytes_structs_and_paths(tmp_path):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "blue.png").write_bytes(png("blue"))
    struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    table = pa.table(
        {
            "image": pa.array(
                [
                    {"bytes": png("red"), "path": "ignored.png"},  # bytes win over the path
                    {"bytes": None, "path": "img/blue.png"},  # datasets' layout for an image on disk
                ],
                type=struct,
            ),
            "question": ["What is 2 + 3?", "Which option?"],
            "answer": ["5", "B"],
            "choices": [None, ["4", "5", "6"]],
            "id": ["q1", "q2"],
            "subject": ["arithmetic", "arithmetic"],
        }
    )
    pq.write_table(table, tmp_path / "d.parquet")
    rows = load_mmk12(tmp_path / "d.parquet")
    assert [r.inputs["image"].getpixel((0, 0)) for r in rows] == [(255, 0, 0), (0, 0, 255)]
    assert rows[0].inputs["image"].mode == "RGB" and rows[0].inputs["image"].size == (8, 6)
    assert rows[0].prompt == PROMPT_TEMPLATE.format(question="What is 2 + 3?")
    assert "<answer></answer>" in rows[0].prompt and "\\boxed{...}" in rows[0].prompt
    assert rows[0].metadata == {
        "subject": "arithmetic",
        "id": "q1",
        "question": "What is 2 + 3?",
        "answer": "5",
        "source": f"{tmp_path / 'd.parquet'}:row 0",
    }
    # Options are listed under the question, lettered.
    assert rows[1].metadata["question"] == "Which option?\nA. 4\nB. 5\nC. 6"
    assert rows[1].metadata["choices"] == ["4", "5", "6"] and "\nB. 5\n" in rows[1].prompt

    # Plain binary and plain path columns, without ids.
    write_parquet(tmp_path / "b.parquet", [{"image": png("green"), "question": "q", "answer": "1"}])
    write_parquet(tmp_path / "p.parquet", [{"image": "img/blue.png", "question": "q", "answer": "1"}])
    (row,) = load_mmk12(tmp_path / "b.parquet")
    assert row.inputs["image"].getpixel((0, 0)) == (0, 128, 0)
    assert row.metadata["id"] == f"{tmp_path / 'b.parquet'}:row 0"
    assert load_mmk12(tmp_path / "p.parquet")[0].inputs["image"].getpixel((0, 0)) == (0, 0, 255)


def test_jsonl_images_as_paths(tmp_path):
    (tmp_path / "blue.png").write_bytes(png("blue"))
    (tmp_path / "rgba.png").write_bytes(png((255, 0, 0, 128)))
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"image": "blue.png", "question": "q1", "answer": "\\frac{1}{2}", "id": 7},
            "",
            {"image": {"path": "rgba.png"}, "question": "q2", "answer": "A", "choices": ["x", "y"]},
        ],
    )
    rows = load_mmk12(path)
    assert [r.metadata["source"] for r in rows] == [f"{path}:1", f"{path}:3"]
    assert rows[0].metadata["id"] == "7" and rows[0].metadata["answer"] == "\\frac{1}{2}"
    assert rows[1].inputs["image"].mode == "RGB"  # RGBA converted
    assert rows[1].metadata["question"] == "q2\nA. x\nB. y"


@pytest.mark.parametrize(
    "row, words",
    [
        ({"question": "q", "answer": "1"}, 'missing "image"'),
        ({"image": "a.png", "answer": "1"}, 'missing "question"'),
        ({"image": "a.png", "question": "q", "answer": 5}, '"answer" must be a non-empty string'),
        ({"image": "a.png", "question": " ", "answer": "5"}, '"question" must be a non-empty string'),
        ({"image": "nope.png", "question": "q", "answer": "1"}, "image file not found: .*nope.png"),
        ({"image": "bad.png", "question": "q", "answer": "1"}, "the image cannot be decoded"),
        ({"image": {"bytes": "aGk="}, "question": "q", "answer": "1"}, "in JSONL give a path"),
        ({"image": 3, "question": "q", "answer": "1"}, '"image" must be bytes, a path'),
        (
            {"image": "a.png", "question": "q", "answer": "D", "choices": ["x", "y"]},
            "one of the option letters A, B",
        ),
        (
            {"image": "a.png", "question": "q", "answer": "A", "choices": ["x"]},
            '"choices" must be a list of 2',
        ),
        (
            {"image": "a.png", "question": "q", "answer": "1", "id": 1.5},
            '"id" must be a string or an integer',
        ),
        ({"image": "a.png", "question": "q", "answer": "1", "source": "x"}, '"source" is reserved'),
        ('{"image": "a.png", ', "not valid JSON"),
        ("[1, 2]", "expected an object"),
    ],
)
def test_bad_rows_name_file_and_row(tmp_path, row, words):
    (tmp_path / "a.png").write_bytes(png("red"))
    (tmp_path / "bad.png").write_bytes(png("red")[:40])  # truncated
    good = {"image": "a.png", "question": "q", "answer": "1"}
    path = write_jsonl(tmp_path / "d.jsonl", [good, row])
    with pytest.raises(DataError, match=f"{path}:2: .*{words}"):
        load_mmk12(path)
    # data.on_bad_row: skip keeps the good row and reports the bad one.
    skipped = []
    assert len(load_mmk12(path, skipped)) == 1
    assert len(skipped) == 1 and f"{path}:2: " in skipped[0]


def test_bad_files(tmp_path):
    with pytest.raises(DataError, match="not found: .*none.parquet"):
        load_mmk12(tmp_path / "none.parquet")
    (tmp_path / "d.csv").write_text("x")
    with pytest.raises(DataError, match=r"d\.csv: MMK12 data must be a \.parquet or \.jsonl"):
        load_mmk12(tmp_path / "d.csv")
    (tmp_path / "x.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match=r"x\.parquet: not a readable parquet file"):
        load_mmk12(tmp_path / "x.parquet")
    with pytest.raises(DataError, match=r"e\.jsonl: no rows"):
        load_mmk12(write_jsonl(tmp_path / "e.jsonl", [""]))
    write_parquet(tmp_path / "bad.parquet", [{"image": b"\x89PNG broken", "question": "q", "answer": "1"}])
    with pytest.raises(DataError, match=r"bad\.parquet:row 0: the image cannot be decoded"):
        load_mmk12(tmp_path / "bad.parquet")


def test_answer_parsing_helpers():
    assert last_boxed("a \\boxed{1} b \\boxed{\\frac{1}{2}} c") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{unclosed") is None and last_boxed("no box") is None
    for text in ["B", "(B)", "B.", "\\text{B}", "$B$", "B. 12", " B: twelve"]:
        assert option_letter(text) == "B", text
    assert option_letter("Bar 2") is None and option_letter("12") is None


S = 1 / 1.3  # one point of reward, in the reward's units


@pytest.mark.slow
@pytest.mark.slow
@pytest.mark.parametrize(
    "response, gold, expected",
    [
        ("The area is 12.\n<answer>\\boxed{12}</answer>", "12", 1.0),
        ("<answer>12</answer>", "12", (1 + 0.15) * S),  # right, one tag, no box
        ("<answer>\\boxed{0.5}</answer>", "\\frac{1}{2}", 1.0),
        ("<answer>\\boxed{\\frac{10}{20}}</answer>", "0.5", 1.0),
        ("<answer>\\boxed{\\sqrt{8}}</answer>", "2\\sqrt{2}", 1.0),
        ("<answer>\\boxed{x = 3}</answer>", "3", 1.0),
        ("<answer>\\boxed{13}</answer>", "12", 0.3 * S),  # wrong: format only
        ("<answer>\\boxed{13 or 12}</answer>", "12", 0.3 * S),  # hedging is wrong
        ("<answer>5</answer> so <answer>\\boxed{12}</answer>", "12", 1.0 * S),  # two tags: last graded
        ("<answer>\\boxed{12}", "12", 0.0),  # no complete tag: nothing graded
        ("The answer is \\boxed{12}", "12", 0.0),
        ("<answer>\\boxed{}</answer>", "12", 0.15 * S),
        ("<answer>\\boxed{B}</answer>", "B", 1.0),  # multiple choice: the letter
        ("<answer>(B) 24</answer>", "B", 1.15 * S),
        ("<answer>\\boxed{C}</answer>", "B", 0.3 * S),
        ("<answer>\\boxed{b}</answer>", "B", 0.3 * S),
    ],
)
def test_reward_hand_cases(reward, response, gold, expected):
    (score,) = reward([response], ["prompt"], [{"answer": gold, "source": "d.jsonl:1"}])
    assert score == pytest.approx(expected)


def test_reward_bad_input_names_the_row(reward):
    with pytest.raises(DataError, match='d.jsonl:4: the mmk12 reward needs a non-empty string "answer"'):
        reward(["<answer>1</answer>"], ["p"], [{"source": "d.jsonl:4"}])
    with pytest.raises(TypeError, match="d.jsonl:4: the mmk12 reward scores response texts, got Image"):
        reward([Image.new("RGB", (2, 2))], ["p"], [{"answer": "1", "source": "d.jsonl:4"}])


@pytest.mark.slow
def test_reward_in_the_pools_threads():
    # math-verify's own timeouts need the main thread: the reason the reward runs it in a child process.
    from math_verify import parse

    errors = []
    t = threading.Thread(target=lambda: errors.append(_raises(lambda: parse("$1$"))))
    t.start()
    t.join()
    assert "threaded environment" in errors[0]

    pool = RewardPool({"mmk12": 1.0}, num_workers=2, timeout_s=120)
    try:
        responses = [
            "<answer>\\boxed{\\frac{3}{6}}</answer>",
            "<answer>0.4</answer>",
            "<answer>\\boxed{A}</answer>",
        ]
        meta = [{"answer": "0.5"}, {"answer": "\\frac{1}{2}"}, {"answer": "A"}]
        result = pool.score([Output(text=r) for r in responses], ["p"] * 3, meta)
        np.testing.assert_allclose(result.per_reward["mmk12"], [1.0, 0.15 / 1.3, 1.0])
    finally:
        pool.close()
        pool.rewards["mmk12"].close()


def _raises(fn) -> str:
    try:
        fn()
    except Exception as e:
        return str(e)
    return ""


@pytest.mark.slow
def test_reward_survives_an_answer_that_hangs_sympy():
    reward = get_reward("mmk12")()
    reward.timeout_s = 1.0
    try:
        start = time.monotonic()
        # 9^(9^(9^9)): sympy's integer power never returns; the child is killed and the answer is wrong.
        (score,) = reward(["<answer>\\boxed{9^{9^{9^{9}}}}</answer>"], ["p"], [{"answer": "1"}])
        assert score == pytest.approx(0.3 / 1.3)
        assert reward._proc is None and time.monotonic() - start < 60  # killed after timeout_s
        # A fresh child grades the next answer.
        assert reward(["<answer>\\boxed{2}</answer>"], ["p"], [{"answer": "2"}]) == [pytest.approx(1.0)]
    finally:
        reward.close()


def _bar_heights(image: Image.Image) -> list[int]:
    """Blue pixels in each quarter of the bar chart: proportional to the drawn bar heights."""
    blue = (np.asarray(image) == (40, 90, 200)).all(-1)  # [H, W]
    return [int(q.sum()) for q in np.array_split(blue, 4, axis=1)]


def _rect_sides(image: Image.Image) -> tuple[int, int]:
    """Width and height in pixels of the black rectangle outline."""
    ys, xs = np.nonzero((np.asarray(image) == 0).all(-1))
    return xs.max() - xs.min(), ys.max() - ys.min()


@pytest.mark.slow
def test_k12_generator_writes_valid_data_whose_answers_match(tmp_path, reward):
    subprocess.run(
        [sys.executable, "scripts/make_k12_data.py", "--out", str(tmp_path), "--train", "10", "--val", "5"],
        cwd=REPO_ROOT,
        check=True,
        capture_output=True,
    )
    rows = load_mmk12(tmp_path / "train.parquet")
    same = load_mmk12(tmp_path / "train.jsonl")
    assert len(rows) == len(same) == 10 and len(load_mmk12(tmp_path / "val.jsonl")) == 5
    assert {r.metadata["kind"] for r in rows} == {
        "rect_area",
        "rect_perimeter",
        "fraction_sum",
        "arith_choice",
        "tallest_bar",
    }
    for a, b in zip(rows, same):
        assert a.prompt == b.prompt
        assert {k: v for k, v in a.metadata.items() if k != "source"} == {
            k: v for k, v in b.metadata.items() if k != "source"
        }
        assert np.array_equal(np.asarray(a.inputs["image"]), np.asarray(b.inputs["image"]))
    for row in rows:
        m, p, image = row.metadata, json.loads(row.metadata["params"]), row.inputs["image"]
        assert image.size == (64, 64)
        kind, letters = m["kind"], "ABCD"
        if kind in ("rect_area", "rect_perimeter"):
            w, h = _rect_sides(image)
            assert abs(w / h - p["w"] / p["h"]) < 0.25  # drawn to scale (rounded to pixels)
            assert m["answer"] == str(p["w"] * p["h"] if kind == "rect_area" else 2 * (p["w"] + p["h"]))
        elif kind == "fraction_sum":
            value = Fraction(p["a"], p["b"]) + Fraction(p["c"], p["d"])
            assert Fraction(m["answer"].replace("\\frac{", "").replace("}{", "/").rstrip("}")) == value
        elif kind == "arith_choice":
            value = p["a"] + p["b"] * p["c"]
            assert m["choices"][letters.index(m["answer"])] == str(value)
            assert len(set(m["choices"])) == 4
        else:
            heights = _bar_heights(image)
            assert np.argsort(heights).tolist() == np.argsort(p["heights"]).tolist()
            assert m["answer"] == letters[int(np.argmax(heights))]
    # The exact answers are gradeable: each scores full marks as the reward's intended response.
    responses = [f"<answer>\\boxed{{{r.metadata['answer']}}}</answer>" for r in rows]
    assert (
        reward(responses, [r.prompt for r in rows], [r.metadata for r in rows]) == [pytest.approx(1.0)] * 10
    )


def test_shipped_tiny_set_is_the_generators_output(tmp_path):
    subprocess.run(
        [sys.executable, "scripts/make_k12_data.py", "--out", str(tmp_path)],
        cwd=REPO_ROOT,
        check=True,
        capture_output=True,
    )
    shipped = REPO_ROOT / "data" / "mmk12_tiny"
    for name in ("train.parquet", "val.parquet"):
        assert pq.read_table(shipped / name).equals(pq.read_table(tmp_path / name)), name
    for name in ("train.jsonl", "val.jsonl"):
        assert (shipped / name).read_text() == (tmp_path / name).read_text()
    assert len(load_mmk12(shipped / "train.parquet")) == 32 and len(load_mmk12(shipped / "val.jsonl")) == 8
