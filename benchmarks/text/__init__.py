"""Text sources the benchmarks share: distinct public-domain books and articles, fetched once and
cached (``benchmarks.text.distinct_text``)."""
