import unittest

from csvline import split_line


class TestSplit(unittest.TestCase):
    def test_plain(self):
        self.assertEqual(split_line("a,b,c"), ["a", "b", "c"])

    def test_quoted_comma(self):
        self.assertEqual(split_line('x,"1,2",y'), ["x", "1,2", "y"])

    def test_empty_fields(self):
        self.assertEqual(split_line(",,"), ["", "", ""])
