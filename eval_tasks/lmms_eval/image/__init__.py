"""What the derived image tasks need beyond upstream's config (:mod:`.utils`)."""
