// One thread that makes the communication calls while the calling thread computes. Open MPI 4.1
// has no asynchronous progress (a message moves only while some thread is inside MPI), so
// overlapping communication with compute needs a thread that sits in MPI meanwhile. Tasks run
// one at a time in the order posted; since every rank posts the same collectives in the same
// order, they match across ranks. MPI runs at MPI_THREAD_SERIALIZED: while tasks are pending,
// the posting thread must not call MPI itself (drain() first).
#pragma once
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

namespace moetrain {

class CommThread {
 public:
  CommThread();
  ~CommThread();  // drains, then joins
  CommThread(const CommThread&) = delete;
  CommThread& operator=(const CommThread&) = delete;

  using Ticket = uint64_t;
  // Queues `task`; returns its ticket (1, 2, 3, ... in posting order).
  Ticket post(std::function<void()> task);
  // Blocks until task `t` and every task before it have finished. If a task threw, the first
  // such exception is rethrown here (and by every later wait) — the run cannot go on.
  void wait(Ticket t);
  void drain();
  // Seconds the calling thread spent blocked in wait/drain: communication not hidden by compute.
  double waited_seconds() const { return waited_; }
  void reset_waited() { waited_ = 0; }
  // Seconds this thread has spent running tasks so far: the communication it carried out,
  // hidden or not (read it between drains for a step's figure).
  double busy_seconds();

 private:
  void loop();

  std::mutex mutex_;
  std::condition_variable work_, done_;
  std::deque<std::function<void()>> queue_;
  Ticket posted_ = 0, finished_ = 0;
  std::exception_ptr error_;
  bool stop_ = false;
  double waited_ = 0;
  double busy_ = 0;     // guarded by mutex_
  std::thread thread_;  // last: started once the members above exist
};

}  // namespace moetrain
