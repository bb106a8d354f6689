"""Distributed start-up is bounded and says what is wrong on one line (issue 39): an
unresolvable rendezvous host, a second node that never comes (within distributed.timeout_s), a
half-set torchrun environment, a master that never answers. Real processes on this machine."""

import socket
import time
from pathlib import Path

TINY = Path(__file__).resolve().parents[1] / "examples" / "tiny" / "config.yaml"
RUN = ["run", TINY, "run.steps=1", "run.device=cpu", "log.progress=false"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unresolvable_rendezvous_host_is_one_line_at_once(tmp_path, harness):
    start = time.monotonic()
    result = harness.run([*RUN, f"run.output_dir={tmp_path / 'r'}", "distributed.nnodes=2",
                          "distributed.rdzv_endpoint=no-such-host.invalid:29500",
                          "distributed.timeout_s=20"], timeout=120)
    harness.error(result, "distributed.rdzv_endpoint=no-such-host.invalid:29500",
                  "does not resolve")
    assert time.monotonic() - start < 60


def test_a_node_that_never_joins_ends_after_timeout_s_on_one_line(tmp_path, harness):
    port = free_port()
    start = time.monotonic()
    result = harness.run([*RUN, f"run.output_dir={tmp_path / 'r'}", "distributed.nnodes=2",
                          f"distributed.rdzv_endpoint=127.0.0.1:{port}",
                          "distributed.timeout_s=5"], timeout=120)
    harness.error(result, "not every node joined", "within distributed.timeout_s=5 s")
    assert f"waiting up to distributed.timeout_s=5 s for 2 nodes to join at 127.0.0.1:{port}" \
        in result.stderr
    assert time.monotonic() - start < 60


def test_a_half_set_torchrun_environment_is_one_line(tmp_path, harness):
    result = harness.run([*RUN, f"run.output_dir={tmp_path / 'r'}"],
                         env={"LOCAL_RANK": "0", "WORLD_SIZE": "2", "RANK": "1"})
    line = harness.error(result, "MASTER_ADDR, MASTER_PORT are not", "torchrun")
    assert line.startswith("error (rank 1): ")
    result = harness.run([*RUN, f"run.output_dir={tmp_path / 'r'}"],
                         env={"LOCAL_RANK": "0", "WORLD_SIZE": "2", "RANK": "2",
                              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
    harness.error(result, "RANK=2, WORLD_SIZE=2")


def test_a_master_that_never_answers_ends_after_timeout_s(tmp_path, harness):
    start = time.monotonic()
    result = harness.run([*RUN, f"run.output_dir={tmp_path / 'r'}", "distributed.timeout_s=5"],
                         env={"LOCAL_RANK": "1", "WORLD_SIZE": "2", "RANK": "1",
                              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())},
                         timeout=120)
    harness.error(result, "rank 1 of 2 could not join the job at 127.0.0.1:",
                  "within distributed.timeout_s=5 s")
    assert time.monotonic() - start < 60
