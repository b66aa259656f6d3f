/* torch's OpenMP threads as the fewbits C kernels see them (the process has one libgomp,
 * torch's): a thread's number, the most a parallel region may have and the threads of the one
 * running; 0, 1 and 1 in a build without -fopenmp. */
#ifndef FEWBITS_THREADS_H
#define FEWBITS_THREADS_H
#ifdef _OPENMP
#include <omp.h>
#define THREAD_ID omp_get_thread_num()
#define MAX_THREADS omp_get_max_threads()
#define TEAM_THREADS omp_get_num_threads()
#else
#define THREAD_ID 0
#define MAX_THREADS 1
#define TEAM_THREADS 1
#endif
#endif
