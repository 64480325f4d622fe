"""The sharded layouts' graceful-stop vote schedule (mindscale/train/resilience/stop.py StopVotes): when the ranks
vote, and that a request is honoured at the next vote. Run here with one process's RankVote (no
communication); tests/integration/test_stopping.py runs it over two msrun workers."""

from mindscale.train.checkpoints.commit import RankVote
from mindscale.train.resilience.stop import MAX_VOTE_DELAY_S, VOTE_BUDGET, StopVotes, vote_interval


def test_the_interval_keeps_a_vote_under_its_budget_and_a_stop_prompt():
    assert vote_interval(0.005, 10.0) == 1  # long steps: every step
    assert vote_interval(0.005, 0.5) == 10  # 5 ms / (0.1% of 0.5 s)
    assert 0.005 / (vote_interval(0.005, 0.5) * 0.5) <= VOTE_BUDGET
    assert vote_interval(0.050, 0.1) == int(MAX_VOTE_DELAY_S / 0.1)  # too costly: capped by the delay
    assert vote_interval(0.0, 0.0) == 1


def test_a_fixed_interval_votes_every_n_steps_and_stops_at_the_next_vote():
    votes = StopVotes(RankVote(1, sharded=True), interval=3)
    asked = [votes.after_step(step >= 4, 0.1) for step in range(1, 10)]
    assert asked == [0, 0, 0, 0, 0, 1, 0, 0, 1]  # votes after steps 3, 6, 9; asked during step 4


def test_auto_votes_after_each_of_the_first_steps_then_as_the_costs_say():
    votes = StopVotes(RankVote(1, sharded=True))
    # vote 1 (its time includes compiling: not used), vote 2 (measured), vote 3 (proposes from vote 2)
    assert [votes.after_step(False, 1e-6) for _ in range(3)] == [0, 0, 0] and votes.votes == 3
    # a measured vote (microseconds here) against microsecond "steps": far above its budget, so the
    # next interval is longer than one step, and the delay cap bounds it
    assert 1 < votes.interval <= MAX_VOTE_DELAY_S / 1e-6
