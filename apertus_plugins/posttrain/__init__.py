"""Post-training and evaluation pieces built on the core: judges, rewards, the code sandbox, preference pairs."""
