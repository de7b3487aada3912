"""Active load bookkeeping and reconciliation with worker load reports."""

from actors.router.load import LoadTracker
from actors.worker.contract import LoadReport

BS = 16
A, B = ("a", 0), ("b", 1)


def _report(inst, rank, blocks, usage=0.5):
    return LoadReport(instance=inst, dp_rank=rank, num_running=1, num_waiting=0, kv_usage=usage,
                      active_kv_blocks=blocks, total_kv_blocks=1000)


def test_prefill_until_first_token_decode_until_finish():
    lt = LoadTracker(BS)
    lt.add_request("r", A, 100, overlap_blocks=2)
    assert lt.prefill_tokens(A) == 100 - 32 and lt.decode_blocks(A) == 7
    lt.first_token("r")
    lt.first_token("r")
    assert lt.prefill_tokens(A) == 0 and lt.decode_blocks(A) == 7
    lt.add_output_tokens("r", 12)  # 112 tokens: still 7 blocks
    assert lt.decode_blocks(A) == 7
    lt.add_output_tokens("r", 1)
    assert lt.decode_blocks(A) == 8
    lt.finish("r")
    lt.finish("r")
    assert lt.decode_blocks(A) == 0 and lt.snapshot() == {}


def test_output_before_first_token_clears_prefill_and_finish_releases_both():
    lt = LoadTracker(BS)
    lt.add_request("r", A, 64)
    lt.add_request("s", A, 32)
    lt.add_output_tokens("r", 1)
    assert lt.prefill_tokens(A) == 32
    lt.finish("s")
    assert lt.prefill_tokens(A) == 0 and lt.decode_blocks(A) == 5


def test_reconcile_takes_max_while_fresh():
    now = [0.0]
    lt = LoadTracker(BS, clock=lambda: now[0], report_ttl=5)
    lt.add_request("r", B, 10 * BS)
    lt.reconcile(_report("b", 1, 3, usage=0.2))
    assert lt.decode_blocks(B) == 10  # own bookkeeping is larger
    lt.reconcile(_report("b", 1, 50, usage=0.4))
    assert lt.decode_blocks(B) == 50 and lt.kv_usage(B) == 0.4  # other frontends' load shows
    now[0] = 6.0
    assert lt.decode_blocks(B) == 10 and lt.kv_usage(B) is None


def test_a_report_older_than_our_last_finish_does_not_count_as_load():
    """A worker's report lags (one per second): taken while our request ran, it still counts that
    request's blocks after we saw it finish. Until the next report our own bookkeeping wins."""
    now = [0.0]
    lt = LoadTracker(BS, clock=lambda: now[0], report_ttl=5)
    lt.add_request("turn1", A, 40 * BS)
    now[0] = 0.5
    lt.reconcile(_report("a", 0, 41))  # sampled while turn1 runs
    assert lt.decode_blocks(A) == 41
    now[0] = 0.6
    lt.finish("turn1")
    assert lt.decode_blocks(A) == 0 and lt.kv_usage(A) == 0.5  # usage is still reported
    now[0] = 1.5
    lt.reconcile(_report("a", 0, 7))  # a newer report (another frontend's traffic) counts again
    assert lt.decode_blocks(A) == 7


def test_sweep_and_remove_worker():
    now = [0.0]
    lt = LoadTracker(BS, clock=lambda: now[0], request_ttl=100)
    lt.add_request("old", A, 32)
    now[0] = 50.0
    lt.add_request("new", B, 32)
    now[0] = 120.0
    assert lt.sweep() == 1 and lt.decode_blocks(A) == 0 and lt.decode_blocks(B) == 2
    lt.reconcile(_report("b", 1, 9))
    lt.remove_worker("b")
    assert lt.decode_blocks(B) == 0 and lt.snapshot() == {}


def test_rerouted_request_id_moves_its_load():
    lt = LoadTracker(BS)
    lt.add_request("r", A, 32)
    lt.add_request("r", B, 32)  # migration re-routes the same id
    assert lt.decode_blocks(A) == 0 and lt.decode_blocks(B) == 2
