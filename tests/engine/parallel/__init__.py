"""Tests of engine/parallel: real gloo ranks on free ports."""
