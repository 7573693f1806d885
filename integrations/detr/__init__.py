"""DETR (End-to-End Object Detection with Transformers) with a pluggable attention choice.

Modules follow the original DETR layout: backbone, position_encoding, transformer, detr (heads and
post-processing), matcher, criterion, box_ops, transforms, datasets, coco_eval, engine, train.
"""
