"""common/rank_exchange.py: rank 0 and actor ranks over torch.distributed point to point (3 gloo processes on a
FileStore)."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import time
import traceback

import numpy as np
import pytest

from common.rank_exchange import Field, Schema, code_digest

SCHEMA = Schema({"obs": Field("uint8", (4, 4)), "actions": Field("int64", (), 0, 3, integral=True),
                 "rewards": Field("float32"), "dones": Field("bool")})


def batch(rows: int, rank: int) -> dict[str, np.ndarray]:
    return {"obs": np.full((rows, 4, 4), rank, np.uint8), "actions": np.arange(rows, dtype=np.int64) % 4,
            "rewards": np.full(rows, 0.5, np.float32), "dones": np.arange(rows) % 2 == 0}


def test_schema_refuses_what_does_not_fit():
    good = batch(8, 1)
    assert SCHEMA.check(good) is None
    assert SCHEMA.check({}) is None
    assert "expected uint8[4, 4]" in SCHEMA.check({**good, "obs": good["obs"].astype(np.float32)})
    assert "expected uint8[4, 4]" in SCHEMA.check({**good, "obs": np.zeros((8, 4, 5), np.uint8)})
    assert "out of range" in SCHEMA.check({**good, "actions": np.full(8, 4, np.int64)})
    assert "NaN" in SCHEMA.check({**good, "rewards": np.full(8, np.nan, np.float32)})
    assert "different lengths" in SCHEMA.check({**good, "rewards": np.zeros(7, np.float32)})
    assert "unknown" in SCHEMA.check({**good, "extra": np.zeros(8, np.float32)})


def test_code_digest_follows_the_code(tmp_path):
    script = tmp_path / "a.py"
    script.write_text("x = 1\n")
    first = code_digest(script)
    assert first == code_digest(script)
    script.write_text("x = 2\n")
    assert code_digest(script) != first


class FakeDist:
    """Just enough of common.distributed.TorchDistributed for the hub, over an initialized gloo group."""

    def __init__(self, rank: int, world_size: int):
        import torch.distributed as dist

        self.dist, self.rank, self.world_size, self.is_main = dist, rank, world_size, rank == 0
        self.p2p_group, self.barrier_at_close, self.lost = None, True, set()

    def gather_objects(self, obj):
        out = [None] * self.world_size
        self.dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj):
        box = [obj]
        self.dist.broadcast_object_list(box, src=0)
        return box[0]

    def peer_lost(self, rank: int) -> None:
        self.lost.add(rank)


def _rank_main(rank: int, world: int, store_file: str, results) -> None:
    import datetime

    import torch.distributed as dist

    from common.distributed import PeerFailure, PeerRefused
    from common.rank_exchange import Hub, Spoke

    os.environ["PRL_COLLECTIVE_TIMEOUT_S"] = "10"
    try:
        dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=10))
        fake = FakeDist(rank, world)
        fingerprint = {"env": "X"} if rank != 3 else {"env": "Y"}  # rank 3 runs another env
        if rank == 0:
            hub = Hub(fake, SCHEMA, logging.getLogger("test.hub"))
            refused = hub.refuse_mismatched(fingerprint)
            hub.start()
            rows, dtypes, ranks, deadline = 0, set(), set(), time.monotonic() + 6
            while time.monotonic() < deadline and not (hub.live == [1] and rows >= 2000):
                for message in hub.drain(0.05):
                    rows += len(message.arrays.get("actions", []))
                    dtypes.add(str(message.arrays["obs"].dtype) if message.arrays else "")
                    ranks.add(message.rank)
                hub.publish({"epsilon": 0.5}, np.arange(5, dtype=np.float32))
            hub.close({"reason": "done", "exit_code": 143})
            results.put((0, {"refused": refused, "rows": rows, "dtypes": sorted(dtypes), "ranks": sorted(ranks),
                             "summary": hub.summary(), "lost": sorted(fake.lost)}))
        else:
            spoke = Spoke(fake)
            try:
                spoke.refuse_mismatched(fingerprint)
            except PeerRefused as err:
                results.put((rank, {"refused": str(err)}))
                return
            exchanges, params, stop = 0, None, None
            while stop is None:
                arrays = batch(64, rank)
                if rank == 2 and exchanges == 3:
                    arrays["actions"][0] = 7  # a broken peer: its data must never reach the learner
                try:
                    reply = spoke.exchange({"steps": exchanges}, arrays)
                except (PeerFailure, PeerRefused) as err:
                    results.put((rank, {"failure": str(err), "exchanges": exchanges}))
                    return
                exchanges += 1
                params = reply.params if reply.params is not None else params
                stop = reply.stop
            results.put((rank, {"exchanges": exchanges, "params": params.tolist(), "stop": stop,
                                "control": reply.control}))
    except Exception:
        results.put((rank, {"error": traceback.format_exc()}))
    finally:
        results.close()
        results.join_thread()  # os._exit would otherwise drop what the queue has not sent yet
        os._exit(0)  # no destroy_process_group: a peer may be gone, as in the real modes


@pytest.mark.timeout(60)
def test_hub_serves_spokes_refuses_mismatch_and_drops_a_broken_peer(tmp_path):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    world = 4
    procs = [ctx.Process(target=_rank_main, args=(r, world, str(tmp_path / "store"), results)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        got = dict(results.get(timeout=45) for _ in range(world))
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    assert not any("error" in v for v in got.values()), got
    hub = got[0]
    assert hub["refused"] == [3] and "rank 3 refused by rank 0" in got[3]["refused"]
    assert "'Y' vs 'X'" in got[3]["refused"]
    # Rank 2 sent an action out of range: dropped, with nothing of that message reaching the learner.
    assert hub["lost"] == [2, 3]
    assert any(e["rank"] == 2 and "does not fit" in e["reason"] for e in hub["summary"]["lost_ranks"])
    assert hub["summary"]["rank_traffic"]["2"]["messages"] == 3
    assert hub["ranks"] in ([1], [1, 2]) and hub["dtypes"] == ["uint8"] and hub["rows"] >= 2000
    assert "refused by rank 0: it sent data that does not fit" in got[2]["failure"]  # and it is told so at once
    # Rank 1 got the parameters, the control values and the final stop with the shared exit status.
    assert got[1]["params"] == [0, 1, 2, 3, 4] and got[1]["control"] == {"epsilon": 0.5}
    assert got[1]["stop"] == {"reason": "done", "exit_code": 143}
