"""The leader/rank machinery every model service runs on (see ``group.py`` and ``rank_main.py``).

Leader side: ``group.RankGroup`` (imports no torch). Rank side: ``step.BaseRankStep``,
run by ``rank_main`` in each rank process. Nothing is re-exported here, so a rank process
does not import the leader's modules and the leader does not import torch.
"""
