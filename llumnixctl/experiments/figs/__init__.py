"""The paper's figures, reproduced with ``llumnixctl simulate`` (one module per figure; scripts/figNN.sh)."""
