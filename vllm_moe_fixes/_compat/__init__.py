"""(exports are filled in at integration)"""
