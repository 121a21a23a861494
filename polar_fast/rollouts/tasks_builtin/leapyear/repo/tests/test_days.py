import unittest

from cal.days import days_in_month, is_leap


class TestDays(unittest.TestCase):
    def test_plain_years(self):
        self.assertTrue(is_leap(2024))
        self.assertFalse(is_leap(2023))

    def test_lengths(self):
        self.assertEqual(days_in_month(2023, 2), 28)
        self.assertEqual(days_in_month(2024, 2), 29)
        self.assertEqual(days_in_month(2024, 4), 30)
