import unittest

from calc import mul


class TestCalc(unittest.TestCase):
    def test_mul(self):
        self.assertEqual(mul(3, 4), 12)


if __name__ == "__main__":
    unittest.main()
