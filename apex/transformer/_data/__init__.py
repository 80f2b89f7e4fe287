from apex.transformer._data._batchsampler import MegatronPretrainingRandomSampler, MegatronPretrainingSampler

__all__ = ["MegatronPretrainingRandomSampler", "MegatronPretrainingSampler"]
