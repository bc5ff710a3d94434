"""A server that starts at once: it answers while the model loads (:class:`~speculum.server.launch.Starting`),
and its calibration runs in the background (:class:`~speculum.calibrate.BackgroundCalibration`):
until the cost curve is known the tree sizer sizes trees by a cautious stand-in curve (still
lossless); the curve is measured one forward per :meth:`step`, saved, then used; a second waiter in
the process and a later process read it instead of measuring again."""

import functools

from conftest import tiny_llama

from speculum import calibrate
from speculum.calibrate import BackgroundCalibration, load_or_measure
from speculum.drafters.ar import AutoregressiveDrafter
from speculum.drafters.suffix import SuffixDrafter
from speculum.engine import Engine
from speculum.runners import HFRunner
from speculum.tree import DraftTree
from speculum.tree_sizing import PROVISIONAL, TreeSizer


def test_background_calibration(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULUM_CACHE", str(tmp_path))  # nothing measured on this "machine" yet
    monkeypatch.setattr(calibrate, "_MEASURED", {})
    monkeypatch.setattr(calibrate, "_PENDING", {})
    model = tiny_llama(seed=5)
    runner = HFRunner(model)
    cal = BackgroundCalibration(runner)
    waiting = BackgroundCalibration(runner)  # a second one in this process waits for the first
    assert cal.measuring and not waiting.measuring and not cal.done
    sizer = TreeSizer(functools.partial(load_or_measure, runner))
    scored = DraftTree([1, 2, 3], [-1, 0, 1], scores=[0.9, 0.8, 0.7])
    assert sizer.cost is PROVISIONAL and 0 < len(sizer.select(scored, 10)) <= 3  # the stand-in meanwhile
    ar = Engine(runner, AutoregressiveDrafter(), eos_token_ids=[])
    sized = Engine(runner, SuffixDrafter(), eos_token_ids=[], sizer=sizer)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    assert sized.generate(prompt, 12).tokens == ar.generate(prompt, 12).tokens
    steps = 0
    while not cal.done:
        cal.step()
        steps += 1
    assert steps > 10 and calibrate._path(cal.key).exists()
    assert sizer.cost is cal.cost and waiting.poll() is cal.cost and not calibrate._PENDING
    monkeypatch.setattr(calibrate, "_MEASURED", {})  # a later process finds it on disk
    later = BackgroundCalibration(runner)
    assert later.done and not later.measuring and later.cost.seconds == cal.cost.seconds


def test_the_server_answers_while_the_model_loads():
    from fastapi import FastAPI
    from starlette.testclient import TestClient

    from speculum.server.launch import Starting

    front = Starting()
    client = TestClient(front)
    health = client.get("/health")
    assert health.status_code == 503 and health.json() == {"status": "loading"}
    busy = client.post("/v1/chat/completions", json={"messages": []})
    assert busy.status_code == 503 and busy.json()["error"]["code"] == "loading" and busy.headers["retry-after"] == "5"
    ready = FastAPI()
    ready.get("/health")(lambda: {"status": "ok"})
    front.app = ready
    assert client.get("/health").json() == {"status": "ok"}
