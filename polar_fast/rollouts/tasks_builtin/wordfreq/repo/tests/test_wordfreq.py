import unittest

from wordfreq import top_words


class TestTop(unittest.TestCase):
    def test_counts(self):
        self.assertEqual(top_words("a b a", 1), [("a", 2)])

    def test_empty(self):
        self.assertEqual(top_words("", 3), [])
