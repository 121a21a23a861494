import unittest

from spans.merge import merge_intervals


class TestMerge(unittest.TestCase):
    def test_overlapping(self):
        self.assertEqual(merge_intervals([(1, 4), (2, 6)]), [(1, 6)])

    def test_disjoint(self):
        self.assertEqual(merge_intervals([(5, 6), (1, 2)]), [(1, 2), (5, 6)])

    def test_empty(self):
        self.assertEqual(merge_intervals([]), [])
