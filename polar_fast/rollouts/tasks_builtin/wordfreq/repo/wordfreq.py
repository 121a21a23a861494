"""Most frequent words in a text."""

import re
from collections import Counter


def top_words(text, k):
    words = re.findall(r"[A-Za-z']+", text)
    counts = Counter(words)
    return counts.most_common(k)
