"""Infrastructure below everything else: Hub ids and the cache (``hub``), the one HTTP client (``client``),
the one gate on upstream versions (``versions``)."""
