import unittest

from numerals import to_roman


class TestRoman(unittest.TestCase):
    def test_additive(self):
        self.assertEqual(to_roman(3), "III")
        self.assertEqual(to_roman(2023), "MMXXIII")

    def test_range(self):
        with self.assertRaises(ValueError):
            to_roman(0)
