"""What a gloo-world worker holds follows the links it holds, not the size of the job.

The short version of ``benchmarks/bench_scale.py``: torchrun jobs of 4 and 8 workers, each worker
calling its two neighbours, then idling until its links are quiet. It checks counts, never times: a
process holds at most a fixed number of threads besides the doorbell watcher, however many links it
holds (an idle same-host link parks with the watcher, impl/_door_watch.py), or, with the same-host
doorbell off (``TWINRPC_SHM=0``), besides one per link (the one receiver an idle link keeps then); the
same bound at both sizes; and its descriptors grow by at most a few per link.
"""

from __future__ import annotations

import gc
import os
from types import ModuleType

import pytest
import torch.distributed as dist
from _benchmarks import load_benchmark
from _gloo_pair import make_pair_groups
from twinrpc.impl._pair import Pair, _gloo_loop_threads

#: threads a process holds besides one per link: the main thread, the timer, the watcher that answers
#: peers asking for a link (impl/_link_table.py), gloo's one event loop (a device shared by every pair
#: group) and the request pool's two pre-started threads
FIXED_THREADS = 6
#: descriptors a link adds: its gloo connection and, on one host, its shared-memory rings (3) and its
#: doorbell (its eventfds and the peer's pidfd: 4, impl/_doorbell.py)
FDS_PER_LINK = 7
#: descriptors rpc adds besides its links: the store's connection, gloo's listening socket and epoll,
#: and the doorbell watcher's epoll and eventfd
FIXED_FDS = 8
#: seconds a worker idles before the counts: a same-host link parks once it has had no message for
#: impl/_receiver.LINGER (a gloo link's second receiver leaves at its next frame by then: heartbeats
#: come every second), and an idle pool thread exits after impl/_pool.IDLE_EXIT
SETTLE = 5.0


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_benchmark("bench_scale")


@pytest.mark.parametrize("size", [4, 8])
def test_threads_and_descriptors_per_process_follow_the_links_held_not_the_world_size(
    bench: ModuleType, size: int
) -> None:
    job = bench.launch("twinrpc", size, "2", 3, SETTLE)
    doorbell = (
        os.environ.get("TWINRPC_SHM", "1") != "0" and os.environ.get("TWINRPC_SHM_DOORBELL", "1") != "0"
    )
    for rank, worker in enumerate(job["workers"]):
        links = worker["links"]
        assert links is not None and 2 <= links <= size - 1, (rank, links)
        settled, before = worker["settled"], worker["before"]
        # besides the fixed ones: the watcher, or one receiver per link
        assert settled["threads"] <= FIXED_THREADS + (1 if doorbell else links), (rank, links, settled)
        assert settled["fds"] - before["fds"] <= FIXED_FDS + FDS_PER_LINK * links, (
            rank,
            links,
            settled,
            before,
        )


def test_pair_groups_made_one_after_another_share_one_gloo_event_loop_thread() -> None:
    """Each pair group made while another's pair is in use joins the same gloo device, so a process
    has one gloo event-loop thread however many peers it links to (what keeps the device alive is
    the pairs: the groups themselves are dropped once their links are built)."""
    store = dist.HashStore()
    before = _gloo_loop_threads()
    pairs = []
    for k in range(3):
        groups = make_pair_groups(dist.PrefixStore(f"pair{k}", store))
        pairs += [Pair(groups[0], 0, 1), Pair(groups[1], 1, 0)]
        del groups
        gc.collect()
    assert len(_gloo_loop_threads() - before) <= 1
    for p in pairs:
        p.abandon()  # closes each pair's connection: nothing of it outlives the test
