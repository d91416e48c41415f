"""``keep_bounded``: a per-signature table never passes its limit, and the oldest key goes first."""

from liger_patch.ops.core.bounded import keep_bounded


def test_the_oldest_key_goes_first_and_a_known_key_is_replaced_in_place():
    table: dict = {}
    for key in range(5):
        keep_bounded(table, key, str(key), 3)
    assert table == {2: "2", 3: "3", 4: "4"}
    keep_bounded(table, 2, "two", 3)  # a key already there: nothing dropped, its place kept
    assert list(table.items()) == [(2, "two"), (3, "3"), (4, "4")]
    keep_bounded(table, 9, "9", 3)
    assert list(table) == [3, 4, 9]
