import unittest

from grid.ops import scale, transpose


class TestOps(unittest.TestCase):
    def test_square(self):
        self.assertEqual(transpose([[1, 2], [3, 4]]), [[1, 3], [2, 4]])

    def test_scale(self):
        self.assertEqual(scale([[1, -2]], 3), [[3, -6]])
