"""``keep_bounded`` and ``touched``: a per-signature table never passes its limit, and the least
recently used key goes first."""

from collections import OrderedDict

from liger_patch.ops.core.bounded import keep_bounded, touched


def test_the_least_recently_used_key_goes_first():
    table: OrderedDict = OrderedDict()
    for key in range(5):
        keep_bounded(table, key, str(key), 3)
    assert list(table.items()) == [(2, "2"), (3, "3"), (4, "4")]
    assert touched(table, 2) == "2" and touched(table, 7, "absent") == "absent"
    keep_bounded(table, 9, "9", 3)  # 3 is now the least recently used, not 2
    assert list(table) == [4, 2, 9]
    keep_bounded(table, 4, "four", 3)  # a key already there: nothing dropped, it becomes the newest
    assert list(table.items()) == [(2, "2"), (9, "9"), (4, "four")]
