"""The pod runner's restart back-off: doubling up to a cap, reset after a long healthy run (as a kubelet)."""

from plimsoll.devcluster.podworker import BACKOFF_MAX_S, BACKOFF_RESET_S, BACKOFF_START_S, restart_backoff


def test_back_off_is_kept_after_a_short_run_and_reset_after_a_long_one() -> None:
    grown = min(BACKOFF_START_S * 8, BACKOFF_MAX_S)
    assert restart_backoff(grown, ran_s=BACKOFF_RESET_S / 2) == grown  # crash-looping: keep waiting longer
    assert restart_backoff(grown, ran_s=BACKOFF_RESET_S) == BACKOFF_START_S
    assert restart_backoff(BACKOFF_MAX_S, ran_s=BACKOFF_RESET_S * 10) == BACKOFF_START_S
