"""The studies' shared pieces (`study`: seeds, tables, the result store; `codec_study`: the
compression study's entries and verdicts), kept with the experiments and out of the library."""
