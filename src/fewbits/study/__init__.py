"""The study: experiments, figures and the report. Sits on top of every other layer.

Submodules are imported on demand (matplotlib is loaded only when a figure is drawn):
fewbits.study.figures draws the format figures used by `fewbits formats --plot` and
`fewbits explain --plot`.
"""
