"""cmx/bench"""
