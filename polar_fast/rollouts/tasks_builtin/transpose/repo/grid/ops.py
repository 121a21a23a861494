"""Small list-of-lists matrix helpers."""


def transpose(matrix):
    if not matrix:
        return []
    n = len(matrix)
    return [[matrix[r][c] for r in range(n)] for c in range(n)]


def scale(matrix, factor):
    return [[value * factor for value in row] for row in matrix]
