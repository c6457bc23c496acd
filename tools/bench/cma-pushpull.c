// cma-pushpull: one block moved from an initiator process I into a target process T
// the ways a same-host WRITE can be copied with CMA, each timed as the median of 200
// rounds (threads spin with sched_yield: fit for 2 cores). Modes:
//   pull-all   T copies it all with process_vm_readv (libfabric 1.17 shm's WRITE);
//   pull+push  T pulls the first half while I pushes the second with process_vm_writev
//              (nixl LIBFABRIC's cma_write: the pins hit the two processes' page tables);
//   pull-2thr  T pulls both halves with two threads (striping over rails);
//   push-2thr  I pushes both halves with two threads.
// Blocks start at a 2 MiB boundary and 4 KiB below one (nixlbench's blocks).
//
//   cc -O2 -pthread -o cma-pushpull tools/bench/cma-pushpull.c && ./cma-pushpull
//
// On the 2-core development machine (off 2093056, GB/s): 2 MiB pull-all 10.4, pull+push
// 19.3, pull-2thr 11.0, push-2thr 9.8; 1 MiB 10.2 / 15.6 / 9.2 / 8.3.
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#define BUF (64ul << 20)
#define ROUNDS 200
struct shared { atomic_int go, done; int mode; size_t size, off; };
static struct shared *sh;
static char *src, *dst;
static pid_t peer;
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static void pin(int c){cpu_set_t s;CPU_ZERO(&s);CPU_SET(c,&s);pthread_setaffinity_np(pthread_self(),sizeof s,&s);}
static void pull(size_t from, size_t len){ // in T
  struct iovec l={dst+sh->off+from,len}, r={src+sh->off+from,len};
  if (process_vm_readv(peer,&l,1,&r,1,0)!=(ssize_t)len){perror("readv");exit(1);} }
static void push(size_t from, size_t len){ // in I
  struct iovec l={src+sh->off+from,len}, r={dst+sh->off+from,len};
  if (process_vm_writev(peer,&l,1,&r,1,0)!=(ssize_t)len){perror("writev");exit(1);} }
struct job { int cpu, in_t; size_t from, len; atomic_int *seen; };
static void *helper(void *a){ struct job *j=a; pin(j->cpu); int seen=0;
  for(;;){ int g; while((g=atomic_load(&sh->go))==seen) sched_yield(); seen=g; if(g<0) return 0;
    size_t h=sh->size/2; if(j->in_t){ if(sh->mode!=2) continue; pull(h,h);} else { if(sh->mode!=3) continue; push(h,h);} atomic_fetch_add(&sh->done,1);} }
int main(int argc,char**argv){
  sh=mmap(0,4096,PROT_READ|PROT_WRITE,MAP_SHARED|MAP_ANONYMOUS,-1,0);
  char *a=mmap(0,BUF+(2<<20),PROT_READ|PROT_WRITE,MAP_PRIVATE|MAP_ANONYMOUS,-1,0);
  char *b=mmap(0,BUF+(2<<20),PROT_READ|PROT_WRITE,MAP_PRIVATE|MAP_ANONYMOUS,-1,0);
  src=(char*)(((unsigned long)a+(2<<20)-1)&~((2ul<<20)-1)); dst=(char*)(((unsigned long)b+(2<<20)-1)&~((2ul<<20)-1));
  pid_t me=getpid(); pid_t c=fork();
  if(c==0){ // T
    peer=me; memset(dst,1,BUF); pin(1);
    pthread_t th; struct job j={0,1,0,0}; pthread_create(&th,0,helper,&j); int seen=0;
    for(;;){ int g; while((g=atomic_load(&sh->go))==seen) sched_yield(); seen=g; if(g<0) break;
      size_t s=sh->size; int m=sh->mode;
      if(m==0) pull(0,s); else if(m==1) pull(0,s/2); else if(m==2) pull(0,s/2); 
      if(m!=3) atomic_fetch_add(&sh->done,1);
    }
    return 0; }
  peer=c; memset(src,2,BUF); pin(0);
  usleep(100000);
  size_t sizes[]={1<<20,2<<20,4<<20}; size_t offs[]={0,(2<<20)-4096};
  int gen=0; pthread_t ith; struct job ij={1,0,0,0}; pthread_create(&ith,0,helper,&ij);
  for(int oi=0;oi<2;oi++) for(int si=0;si<3;si++) { double best[4]={0};
    for(int m=0;m<4;m++){
      // modes 2 and 3 need a helper thread; mode 3 pushes from two I threads
      sh->mode=m; sh->size=sizes[si]; sh->off=offs[oi]; double t[ROUNDS];
      
      int want = m==0?1: m==1?2: 2;
      for(int r=0;r<ROUNDS;r++){ atomic_store(&sh->done,0); double t0=now(); atomic_store(&sh->go,++gen);
        if(m==1){ push(sizes[si]/2,sizes[si]/2); atomic_fetch_add(&sh->done,1);} if(m==3){ push(0,sizes[si]/2); atomic_fetch_add(&sh->done,1);} 
        while(atomic_load(&sh->done)<want) sched_yield();
        t[r]=now()-t0; }
      
      // median
      for(int x=0;x<ROUNDS;x++) for(int y=x+1;y<ROUNDS;y++) if(t[y]<t[x]){double z=t[x];t[x]=t[y];t[y]=z;}
      best[m]=sizes[si]/t[ROUNDS/2]/1e9;
    }
    printf("off %7zu size %5zu KiB: pull-all %.1f  pull+push %.1f  pull-2thr %.1f  push-2thr %.1f GB/s\n", offs[oi], sizes[si]>>10, best[0],best[1],best[2],best[3]);
  }
  atomic_store(&sh->go,-1); kill(c,9); return 0; }
