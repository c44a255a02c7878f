"""KVPoll: the ordered transfer states, forward-only updates and the MIN reduction across ranks."""

from __future__ import annotations

import itertools

import pytest

from pdsim.core.kvpoll import KVPoll, advance, reduce_polls

ORDER = [KVPoll.Failed, KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring,
         KVPoll.Success]


def test_states_are_ordered_as_in_the_design():
    assert [int(s) for s in ORDER] == [0, 1, 2, 3, 4]
    assert sorted(KVPoll) == ORDER
    assert KVPoll.Failed < KVPoll.Bootstrapping < KVPoll.WaitingForInput
    assert KVPoll.WaitingForInput < KVPoll.Transferring < KVPoll.Success


@pytest.mark.parametrize("current,new", list(itertools.product(ORDER[1:], ORDER[1:])))
def test_advance_only_moves_forward(current, new):
    assert advance(current, new) is max(current, new)


def test_advance_a_transfer_through_its_life():
    state = KVPoll.Bootstrapping
    for reported, expected in [
        (KVPoll.WaitingForInput, KVPoll.WaitingForInput),
        (KVPoll.Bootstrapping, KVPoll.WaitingForInput),  # a late message cannot move it back
        (KVPoll.Transferring, KVPoll.Transferring),
        (KVPoll.WaitingForInput, KVPoll.Transferring),
        (KVPoll.Success, KVPoll.Success),
        (KVPoll.Transferring, KVPoll.Success),
    ]:
        state = advance(state, reported)
        assert state is expected


@pytest.mark.parametrize("state", ORDER)
def test_failed_is_sticky_and_wins(state):
    assert advance(KVPoll.Failed, state) is KVPoll.Failed
    assert advance(state, KVPoll.Failed) is KVPoll.Failed


def test_reduce_polls_is_the_minimum():
    assert reduce_polls([KVPoll.Success, KVPoll.Transferring, KVPoll.Success]) is KVPoll.Transferring
    assert reduce_polls([KVPoll.Success] * 4) is KVPoll.Success
    assert reduce_polls([KVPoll.WaitingForInput]) is KVPoll.WaitingForInput
    assert reduce_polls(iter([KVPoll.Transferring, KVPoll.Bootstrapping])) is KVPoll.Bootstrapping


def test_reduce_polls_one_failed_rank_fails_all():
    assert reduce_polls([KVPoll.Success, KVPoll.Success, KVPoll.Failed, KVPoll.Success]) is KVPoll.Failed
    assert reduce_polls([KVPoll.Failed, KVPoll.Success]) is KVPoll.Failed


def test_reduce_polls_accepts_plain_ints_and_returns_a_kvpoll():
    result = reduce_polls([4, 3])
    assert result is KVPoll.Transferring


@pytest.mark.parametrize("empty", [[], (), iter([])])
def test_reduce_polls_of_nothing_raises(empty):
    with pytest.raises(ValueError, match="at least one poll"):
        reduce_polls(empty)
