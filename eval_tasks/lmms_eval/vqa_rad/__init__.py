"""VQA-RAD (Table 34, Medical Imaging): this package's lmms-eval task, where lmms-eval has none (:mod:`.utils`)."""
