"""Infrastructure below everything else: Hub ids and the cache (``hub``), the released Hub ids and their other
spelling (``release_ids``), the one HTTP client (``client``), the one gate on upstream versions (``versions``)."""
