/* pvisor-workset's entry (workset.c), linked into the agent's binary, which calls it by argv[0]. */
#ifndef PVISOR_WORKSET_H
#define PVISOR_WORKSET_H
int workset_main(int argc, char **argv);
#endif
